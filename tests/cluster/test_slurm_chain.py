"""Chains on the real local SLURM: ``submit stage2 --after stage1``.

Stage 1 cannot finish within its 1-minute limit, so SLURM requeues it (same job id, restart count
grows) at least once; stage 2 is submitted held (``sbatch --hold``) right after it and must start
only after stage 1's ``finished``, from stage 1's weights. A stage 1 that fails (non-finite steps)
must keep its stage 2 from ever running, and ``status`` of both must say so. Both chains are
submitted when the module starts and run side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.runlib import (
    TINY,
    events,
    hpclaunch,
    outlasting,
    status,
    synth_data,
    tiny_overrides,
    wait_for,
    wait_run_done,
)

if TYPE_CHECKING:
    from tests.cluster.conftest import SlurmCluster

# (a ceiling, not a margin: a stage waits behind the other modules' jobs on a loaded CI machine)
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(1500)]

# Too long for one 1-minute attempt on any machine (as in test_slurm_runs): requeued at least once.
# Few steps, long sleeps: a loaded machine's compute per step does not multiply the attempts.
STAGE1_STEPS = 80
LONG = (
    *outlasting(STAGE1_STEPS, 0.8, time_limit_s=60, stop_margin_s=4),
    "train.log_every=10",
    "checkpoint.every_steps=20",
    "train.ema_decay=0.9",
)
SHORT = ("train.steps=20", "train.warmup_steps=2", "train.log_every=5")


def _submit(work: Path, data: Path, name: str, *extra: str, after: Path | None = None) -> Any:
    args = [
        "submit",
        str(TINY),
        *tiny_overrides(work, data, name, "scheduler.kind=slurm", *extra),
        "--no-preflight",
    ]
    if after is not None:
        args += ["--after", str(after)]
    return hpclaunch(*args, cwd=work)


@pytest.fixture(scope="module")
def chains(slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("slurm-chain")
    data = synth_data(work / "data")
    runs = work / "runs"
    _submit(work, data, "stage1", "scheduler.time_limit=00:01:00", *LONG)
    # Fails at step 60 (non-finite, never retried): long after its stage 2 is registered.
    _submit(
        work,
        data,
        "bad1",
        "train.steps=200",
        "testing.step_sleep_s=0.1",
        "testing.inject_nonfinite_at=[60]",
        "train.max_nonfinite_skips=1",
    )
    init = (f"train.init_from={runs / 'stage1'}", "train.init_from_ema=true")
    out = _submit(work, data, "stage2", *SHORT, *init, after=runs / "stage1")
    assert "held until it finishes" in out.stdout, out.stdout
    _submit(work, data, "bad2", *SHORT, after=runs / "bad1")
    return {"work": work, **{n: runs / n for n in ("stage1", "stage2", "bad1", "bad2")}}


def _job(run: Path) -> str:
    return str(next(e["job_id"] for e in events(run) if e["event"] == "submitted"))


def _first(run: Path, name: str) -> dict[str, Any]:
    return next(e for e in events(run) if e["event"] == name)


def test_stage2_starts_after_a_requeued_stage1_finishes(
    slurm_cluster: SlurmCluster, chains: dict[str, Path]
) -> None:
    work, stage1, stage2 = chains["work"], chains["stage1"], chains["stage2"]
    # While stage 1 trains (and after its requeue), stage 2 is a held SLURM job that has not started.
    wait_for(
        lambda: any(e["event"] == "requeued" for e in events(stage1)), timeout=300, what="stage 1's requeue"
    )
    info = slurm_cluster.job_info(_job(stage2))
    assert info["JobState"] == "PENDING" and "Held" in info.get("Reason", ""), info
    assert not any(e["event"] == "started" for e in events(stage2))

    s1 = wait_run_done(stage1, work, timeout=1200)
    assert s1["state"] == "finished", json.dumps(s1, indent=1)[-3000:]
    ends = [(a["end"], a["cause"]) for a in s1["attempts"]]
    assert len(ends) >= 2 and ends[0] == ("requeued", "timeout"), ends
    s2 = wait_run_done(stage2, work, timeout=600)
    assert s2["state"] == "finished", json.dumps(s2, indent=1)[-3000:]
    assert _first(stage2, "started")["ts"] >= _first(stage1, "finished")["ts"]
    released = [e for e in events(stage2) if e["event"] == "chain_released"]
    # Released once, by stage 1's agent or by the test's own `status` of stage 1 when it looked
    # between the agent's `finished` and its release (both settle a chain).
    assert len(released) == 1 and released[0]["by"] in ("agent", "hpclaunch status"), released
    assert s2["chain"]["after"]["outcome"] == "released"
    assert s1["chain"]["next"][0]["outcome"] == "released"
    assert s2["weights_from"]["step"] == STAGE1_STEPS and s2["weights_from"]["ema"] is True
    assert s2["attempts"][0]["resumed_step"] == 0


def test_a_failed_stage1_keeps_stage2_from_running(
    slurm_cluster: SlurmCluster, chains: dict[str, Path]
) -> None:
    work, bad1, bad2 = chains["work"], chains["bad1"], chains["bad2"]
    s1 = wait_run_done(bad1, work, timeout=1200)
    assert s1["state"] == "failed", json.dumps(s1, indent=1)[-3000:]
    s2 = wait_for(
        lambda: (s := status(bad2, work))["state"] == "cancelled" and s, timeout=60, what="stage 2 cancelled"
    )
    assert s2["chain"]["after"]["outcome"] == "cancelled"
    assert "failed" in s2["chain"]["after"]["reason"] and "non-finite" in s2["chain"]["after"]["reason"]
    assert not any(e["event"] == "started" for e in events(bad2))
    assert slurm_cluster.wait_job(_job(bad2), timeout=60) == "CANCELLED"
    shown = " ".join(hpclaunch("status", str(bad2), cwd=work).stdout.split())
    assert "never runs" in shown and "failed" in shown
    # Chaining after a run that has already failed is refused: nothing submitted, exit 2.
    late = hpclaunch(
        "submit",
        str(TINY),
        "--set",
        f"run_dir={work / 'runs' / 'late'}",
        "--after",
        str(bad1),
        cwd=work,
        check=False,
    )
    assert (
        late.returncode == 2 and "would never start" in late.stderr and not (work / "runs" / "late").exists()
    )
