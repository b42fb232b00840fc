"""The lint that runs on every render refuses or warns with a reason."""

from __future__ import annotations

import pytest

from hpclaunch.config import RunConfig, load_config
from hpclaunch.errors import ScriptLintError
from hpclaunch.orchestrator.launch import prepare
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.templates.lint import lint_slurm, sbatch_directives

pytestmark = pytest.mark.fast

SLURM = ["scheduler.kind=slurm", "run_dir=/runs/x"]
PBS = ["scheduler.kind=pbs", "run_dir=/runs/x"]


def render(overrides: list[str]) -> object:
    return prepare(load_config(None, overrides))


@pytest.mark.parametrize(
    "directive,match",
    [
        ("#SBATCH --nodes=4", "contradicts scheduler.nodes=1"),
        ("#SBATCH --ntasks=8", "contradicts the plan's one task per node"),
        ("#SBATCH -n 8", "contradicts the plan's one task per node"),
        ("#SBATCH --ntasks-per-node=8", "contradicts"),
        ("#SBATCH --signal=B:USR1@60", "contradicts"),
        ("#SBATCH --open-mode=truncate", "contradicts"),
        ("#SBATCH --no-requeue", r"contradicts the generated one \(--requeue\)"),
        ("#SBATCH --open-mode=truncate", r"contradicts the generated one \(--open-mode=append\)"),
        ("#SBATCH -t 10", "contradicts"),
    ],
)
def test_extra_directives_that_contradict_are_refused(directive: str, match: str) -> None:
    with pytest.raises(ScriptLintError, match=match):
        render([*SLURM, f"scheduler.extra_directives=['{directive}']"])


def test_extra_directives_that_agree_with_the_plan_pass() -> None:
    warnings = render(  # type: ignore[attr-defined]
        [
            *SLURM,
            "scheduler.nodes=2",
            "scheduler.extra_directives=['#SBATCH --nodes=2', '#SBATCH --ntasks=2']",
        ]
    ).rendered.warnings
    assert any("repeats the generated one" in w for w in warnings)


def test_gres_that_contradicts_the_gpus_is_refused() -> None:
    gpus = [*SLURM, "scheduler.gpus_per_node=8"]
    with pytest.raises(ScriptLintError, match=r"contradicts scheduler\.gpus_per_node=8"):
        render([*gpus, "scheduler.extra_directives=['#SBATCH --gres=gpu:a100:4']"])
    render([*gpus, "scheduler.extra_directives=['#SBATCH --gres=gpu:8']"])  # agrees: fine


@pytest.mark.parametrize("export", ["NONE", "PATH,HOME", "nil"])
def test_export_that_drops_the_environment_with_pass_env_is_refused(export: str) -> None:
    with pytest.raises(
        ScriptLintError, match=r"launch\.pass_env \(WANDB_API_KEY\) would never reach the job"
    ):
        render(
            [
                *SLURM,
                "launch.pass_env=[WANDB_API_KEY]",
                f"scheduler.extra_directives=['#SBATCH --export={export}']",
            ]
        )
    render([*SLURM, f"scheduler.extra_directives=['#SBATCH --export={export}']"])  # no pass_env: allowed
    render(
        [*SLURM, "launch.pass_env=[WANDB_API_KEY]", "scheduler.extra_directives=['#SBATCH --export=ALL,X=1']"]
    )


def test_harmless_extra_directive_is_kept_after_the_generated_ones() -> None:
    text = render([*SLURM, "scheduler.extra_directives=['#SBATCH --mail-type=END']"]).rendered.text  # type: ignore[attr-defined]
    keys = [k for k, _, _ in sbatch_directives(text)]
    assert keys[-1] == "--mail-type" and "--signal" in keys


def test_pbs_contradicting_walltime_is_refused() -> None:
    with pytest.raises(ScriptLintError, match="contradicts"):
        render([*PBS, "scheduler.extra_directives=['#PBS -l walltime=100:00:00']"])


def test_walltime_shorter_than_the_stop_lead_is_refused() -> None:
    script = "#!/bin/bash\n#SBATCH --ntasks-per-node=1\n#SBATCH --open-mode=append\n#SBATCH --signal=USR2@12\n#SBATCH --time=1\n"
    plan = build(load_config(None, [*SLURM, "scheduler.time_limit=60s"]), python="python3")
    plan = plan.model_copy(update={"save_estimate_s": 40.0})  # 1.5 x 40 + 10 s margin = 70 s > 60 s
    findings = lint_slurm(script, generated_lines=5, plan=plan)
    assert any(
        f.severity == "error" and "not longer than the stop lead time 70 s" in f.message for f in findings
    )


def test_missing_append_and_batch_signal_are_errors() -> None:
    script = "#!/bin/bash\n#SBATCH --ntasks-per-node=2\n#SBATCH --signal=B:USR1@60\n#SBATCH --time=60\n"
    messages = [
        f.message for f in lint_slurm(script, generated_lines=4, plan=build(RunConfig(), python="python3"))
    ]
    assert any("one task per node" in m for m in messages)
    assert any("--open-mode=append is missing" in m for m in messages)
    assert any("reaches only the batch shell" in m for m in messages)


def test_sub_minute_limit_on_slurm_warns_about_rounding() -> None:
    warnings = render([*SLURM, "scheduler.time_limit=90s", "launch.stop_lead_s=20"]).rendered.warnings  # type: ignore[attr-defined]
    assert any("whole minutes" in w for w in warnings)


def test_multi_node_pbs_starts_one_agent_per_node() -> None:
    # PBS Pro's pbsdsh has no -u: it starts one task per select chunk, and each chunk is one node
    text = render([*PBS, "scheduler.nodes=2", "scheduler.pbs_launcher=pbsdsh"]).rendered.text  # type: ignore[attr-defined]
    assert '\npbsdsh -- /usr/bin/env PBS_NODEFILE="$PBS_NODEFILE" ' in text
    torque = [*PBS, "scheduler.nodes=2", "scheduler.pbs_launcher=pbsdsh", "scheduler.pbs_dialect=torque"]
    assert "\npbsdsh -u -- " in render(torque).rendered.text  # type: ignore[attr-defined]
    text = render([*PBS, "scheduler.nodes=2"]).rendered.text  # type: ignore[attr-defined]
    assert "mpiexec -n 2 --ppn 1" in text


def test_pbs_exclude_is_named_not_dropped_silently() -> None:
    out = render([*PBS, "scheduler.exclude=[n7]"])
    assert any("scheduler.exclude n7 is not applied" in w for w in out.rendered.warnings)  # type: ignore[attr-defined]
