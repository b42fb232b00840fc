"""Every job script hpclaunch renders passes ShellCheck with nothing to say (issue 39, 14): SLURM,
PBS Pro, Torque and local, each example, sweeps, multi-node PBS launchers, the rescue jobs, and a
run directory whose path a shell would misread. A script that ``cd``s without ``|| exit`` went on in
$HOME on a node without the run directory's filesystem (SC2164).

Skipped where shellcheck is not installed (``apt-get install shellcheck``); CI installs it and sets
HPCLAUNCH_REQUIRE_SHELLCHECK=1, which turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.cli import main

pytestmark = pytest.mark.spawns  # shellcheck itself

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
AS = {
    "own": [],
    "slurm": ["--scheduler", "slurm"],
    "pbs-pro": ["--scheduler", "pbs", "--pbs-dialect", "pro"],
    "torque": ["--scheduler", "pbs", "--pbs-dialect", "torque"],
}
FIXED = ["--set", "launch.python=/opt/venv/bin/python", "--set", "run_dir=/runs/x"]
WEIRD = "/runs/a'; echo foo/b c$HOME"  # quotes, a space, a dollar: one path, never code


@pytest.fixture(scope="module")
def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None:
        if os.environ.get("HPCLAUNCH_REQUIRE_SHELLCHECK") == "1":
            pytest.fail("shellcheck is not installed, and HPCLAUNCH_REQUIRE_SHELLCHECK=1 (CI) requires it")
        pytest.skip("shellcheck is not installed here (apt-get install shellcheck); CI runs this test")
    return found


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("HPCLAUNCH_DEBUG", raising=False)
    yield


def _render(out: Path, *args: str) -> Path:
    assert main(["render", *args, "-o", str(out)]) == 0, args
    return out


def _check(shellcheck: str, scripts: list[Path], *, severity: str = "style") -> None:
    """Nothing at all to say at ``style`` (every level: error, warning, info, style)."""
    done = subprocess.run(
        [shellcheck, "--format=gcc", f"--severity={severity}", *map(str, scripts)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_as_each_scheduler_and_its_rescue(
    shellcheck: str, example: Path, tmp_path: Path
) -> None:
    scripts = []
    for name, flags in AS.items():
        scripts.append(_render(tmp_path / f"{name}.sh", str(example), *FIXED, *flags))
        if name != "own" or "kind: local" not in example.read_text():
            scripts.append(_render(tmp_path / f"{name}.rescue.sh", str(example), *FIXED, *flags, "--rescue"))
    _check(shellcheck, scripts)


def test_sweeps_launchers_the_local_script_and_a_path_a_shell_would_misread(
    shellcheck: str, tmp_path: Path
) -> None:
    tiny, pbs = str(ROOT / "examples" / "tiny.yaml"), str(ROOT / "examples" / "pbs-pro.yaml")
    sweep = ["--sweep", "train.lr=1e-4,3e-4", "--sweep", "model.depth=2,4"]
    scripts = [_render(tmp_path / "local.sh", tiny, *FIXED)]
    for name, flags in AS.items():
        scripts.append(_render(tmp_path / f"sweep-{name}.sh", pbs, *FIXED, *flags, *sweep))
    for launcher in ("mpiexec", "pbsdsh"):
        for dialect in ("pro", "torque"):
            flags = ["--pbs-dialect", dialect, "--set", f"scheduler.pbs_launcher={launcher}"]
            scripts.append(_render(tmp_path / f"{launcher}-{dialect}.sh", pbs, *FIXED, *flags))
    _check(shellcheck, scripts)
    # A path with a literal $ is single-quoted on purpose: ShellCheck's info note SC2016 ("expressions
    # don't expand in single quotes") asks whether expansion was meant; it was not. No warning, though.
    # (SLURM and PBS refuse such a run_dir: it would be written into a #SBATCH/#PBS line.)
    weird = [
        _render(
            tmp_path / "weird-local.sh",
            tiny,
            "--set",
            f"launch.python={WEIRD}/py",
            "--set",
            f"run_dir={WEIRD}",
        )
    ]
    for name, flags in AS.items():
        odd_python = ["--set", "run_dir=/runs/x", "--set", f"launch.python={WEIRD}/python", *flags]
        weird.append(_render(tmp_path / f"weird-python-{name}.sh", tiny, *odd_python))
    _check(shellcheck, weird, severity="warning")


@pytest.mark.parametrize("scheduler", ["local", "pbs"])
def test_a_node_without_the_run_directory_stops_at_once_saying_so(scheduler: str, tmp_path: Path) -> None:
    """SC2164 for real: without `|| exit` the script went on in $HOME and started the agent there."""
    example = ROOT / "examples" / ("tiny.yaml" if scheduler == "local" else "pbs-pro.yaml")
    gone = tmp_path / "not-mounted-here" / "run"
    script = _render(
        tmp_path / "job.sh", str(example), "--set", f"run_dir={gone}", "--set", "launch.python=/bin/echo"
    )
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"cannot enter {gone}" in done.stderr and done.stdout == ""  # the agent never started
