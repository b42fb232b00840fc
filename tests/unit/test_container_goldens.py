"""pyxis and Apptainer cannot run on this machine (pyxis is a SLURM plugin built against a site's
Slurm; Apptainer is not in Debian 12's packages), so their job scripts are golden files
(``test_render_golden.py``) and these tests read them: the line each node's agent would run,
parsed back as the shell would, holds what the design promises (the agent outside, the ranks in
the image, the run directory and data at their own paths, GPUs, variables by name only)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
LAUNCH = ["-u", "-m", "hpclaunch.rank.host"]
RUN, DATA = "/runs/mmdit-8xh100", ["/datasets/ldlm/tokens", "/datasets/ldlm/latents"]
NODE_DIR = "NODE_DIR:/tmp/NODE_DIR"  # this user's node-local directory, at /tmp/<its name> in the image


def _lines(name: str) -> tuple[list[str], str]:
    """The rank host's command (from the script's comment) and the agent's launch line."""
    text = (GOLDEN / name).read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# container ("))
    argv = shlex.split(lines[at + 1].removeprefix("#   "))
    agent = next(line for line in lines if "hpclaunch.jobs.agent" in line and not line.startswith("#"))
    assert "WANDB_API_KEY=" not in text  # a secret passes by name, never by value
    return argv, agent


def test_pyxis_golden_script_not_run_here() -> None:
    argv, agent = _lines("slurm-8xh100-pyxis.sbatch")
    # the agents' step stays on the nodes (it needs scontrol, the node checks, the signals)
    assert agent.startswith("srun ") and "--container" not in agent
    # each agent starts a one-task step on its own node, in the image
    assert argv[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=NODE"]
    flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    assert flags["--container-image"] == "nvcr.io#nvidia/pytorch:24.05-py3"
    mounts = flags["--container-mounts"].split(",")
    assert {f"{p}:{p}" for p in [RUN, *DATA]} <= set(mounts) and "/scratch:/scratch" in mounts
    assert NODE_DIR in mounts  # what the ranks share with their agent (issue 49, H1)
    assert flags["--container-workdir"] == RUN
    assert flags["--gpus-per-node"] == "8"
    assert set(flags["--container-env"].split(",")) == {"HF_HOME", "OMP_NUM_THREADS", "WANDB_API_KEY"}
    # and, on the node, every HPCLAUNCH_/NCCL_/TORCH_/GLOO_ variable set there (issue 49, L4)
    assert (
        "--container-env also names each variable set on the node"
        in (GOLDEN / "slurm-8xh100-pyxis.sbatch").read_text()
    )
    assert argv[-4:] == ["python", *LAUNCH]


@pytest.mark.parametrize("name", ["slurm-8xh100-apptainer.sbatch", "pbs-pro-apptainer.pbs"])
def test_apptainer_golden_script_not_run_here(name: str) -> None:
    argv, agent = _lines(name)
    assert "apptainer" not in agent
    assert argv[:3] == ["apptainer", "exec", "--nv"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    run = RUN if name.startswith("slurm") else "/runs/mmdit-pbs"
    data = DATA if name.startswith("slurm") else ["/scratch/ldlm/tokens", "/scratch/ldlm/latents"]
    assert {f"{p}:{p}" for p in [run, *data]} | {NODE_DIR} == set(binds)
    assert argv[argv.index("--pwd") + 1] == run
    assert argv[-5:] == ["/images/mmdit.sif", "python3", *LAUNCH]
    text = (GOLDEN / name).read_text()
    assert (
        "# passed as APPTAINERENV_<name>, the node's value winning over the image's: HPCLAUNCH_* NCCL_*"
        in text
    )
