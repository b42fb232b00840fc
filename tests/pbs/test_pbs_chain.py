"""Chains on the real OpenPBS: ``submit stage2 --after stage1``.

Stage 1 outgrows its 60 s walltime, so it continues through a continuation job with a new id
(``qsub -W depend=afterany:...``): a dependency on stage 1's first job id would have started stage 2
after stage 1's first attempt. Stage 2 is submitted held (``qsub -h``), registered in stage 1's run
directory, and released by stage 1's last job once it has finished. A stage 1 that fails keeps its
stage 2 from ever running. Both chains are submitted when the module starts and run side by side.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tests.pbs.conftest import user_dir
from tests.pbs.pbslib import status, synth_data, wait_run_done
from tests.runlib import TINY, events, outlasting, tiny_overrides, wait_for

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = [pytest.mark.pbs, pytest.mark.slow]

# Stage 1 outlasts its 60 s walltime on any machine (its sleep alone), so it is always continued.
STAGE1_STEPS = 100  # (few steps, long sleeps: a loaded machine's compute does not add attempts)
LONG = (
    *outlasting(STAGE1_STEPS, 0.6, time_limit_s=60, stop_margin_s=8),
    "train.log_every=10",
    "checkpoint.every_steps=50",
    "train.ema_decay=0.9",
)
SHORT = ("train.steps=20", "train.warmup_steps=2", "train.log_every=5", "scheduler.time_limit=00:05:00")


def _submit(
    server: PbsServer, work: Path, data: Path, name: str, *extra: str, after: Path | None = None
) -> str:
    args = [
        "submit",
        str(TINY),
        *tiny_overrides(work, data, name, "scheduler.kind=pbs", *extra),
        "--no-preflight",
    ]
    if after is not None:
        args += ["--after", str(after)]
    return server.hpclaunch(*args, cwd=work).stdout


@pytest.fixture(scope="module")
def chains(pbs_server: PbsServer) -> dict[str, Path]:
    work = user_dir(pbs_server, "chain")
    data = synth_data(pbs_server, work / "data")
    runs = work / "runs"
    _submit(pbs_server, work, data, "stage1", "scheduler.time_limit=60s", *LONG)
    bad = (
        "train.steps=200",
        "testing.step_sleep_s=0.1",
        "testing.inject_nonfinite_at=[60]",
        "train.max_nonfinite_skips=1",
    )
    _submit(pbs_server, work, data, "bad1", "scheduler.time_limit=00:05:00", *bad)
    init = (f"train.init_from={runs / 'stage1'}", "train.init_from_ema=true")
    out = _submit(pbs_server, work, data, "stage2", *SHORT, *init, after=runs / "stage1")
    assert "held until it finishes" in out, out
    _submit(pbs_server, work, data, "bad2", *SHORT, after=runs / "bad1")
    return {"work": work, **{n: runs / n for n in ("stage1", "stage2", "bad1", "bad2")}}


def _job(run: Path) -> str:
    return str(next(e["job_id"] for e in events(run) if e["event"] == "submitted"))


def _first(run: Path, name: str) -> dict[str, Any]:
    return next(e for e in events(run) if e["event"] == name)


def test_stage2_starts_after_stage1_finishes_through_continuation_jobs(
    pbs_server: PbsServer, chains: dict[str, Path]
) -> None:
    stage1, stage2 = chains["stage1"], chains["stage2"]
    wait_for(
        lambda: any(e["event"] == "requeued" for e in events(stage1)),
        timeout=300,
        what="stage 1's continuation",
    )
    assert pbs_server.job(_job(stage2))["job_state"] == "H"  # held while stage 1 goes on under a new job id
    assert not any(e["event"] == "started" for e in events(stage2))

    s1 = wait_run_done(pbs_server, stage1, timeout=600)
    assert s1["state"] == "finished", json.dumps(s1, indent=1)[-3000:]
    jobs = [a["job_id"] for a in s1["attempts"]]
    assert len(jobs) >= 2 and len(set(jobs)) == len(jobs), jobs  # continuation jobs: new ids
    s2 = wait_run_done(pbs_server, stage2, timeout=300)
    assert s2["state"] == "finished", json.dumps(s2, indent=1)[-3000:]
    assert _first(stage2, "started")["ts"] >= _first(stage1, "finished")["ts"]
    released = [e for e in events(stage2) if e["event"] == "chain_released"]
    # Released once, by stage 1's agent or by the test's own `status` of stage 1 when it looked
    # between the agent's `finished` and its release (both settle a chain; CI saw the second).
    assert len(released) == 1 and released[0]["by"] in ("agent", "hpclaunch status"), released
    assert s1["chain"]["next"][0]["outcome"] == "released"
    assert s2["weights_from"]["step"] == STAGE1_STEPS and s2["weights_from"]["ema"] is True


def test_a_failed_stage1_keeps_stage2_from_running(pbs_server: PbsServer, chains: dict[str, Path]) -> None:
    bad1, bad2 = chains["bad1"], chains["bad2"]
    s1 = wait_run_done(pbs_server, bad1, timeout=400)
    assert s1["state"] == "failed", json.dumps(s1, indent=1)[-3000:]
    s2 = wait_for(
        lambda: (s := status(pbs_server, bad2))["state"] == "cancelled" and s,
        timeout=60,
        what="stage 2 cancelled",
    )
    after = s2["chain"]["after"]
    assert after["outcome"] == "cancelled" and "failed" in after["reason"], after
    assert not any(e["event"] == "started" for e in events(bad2))
    record = pbs_server.wait_job(_job(bad2), timeout=60)
    assert record["job_state"] == "F"
    shown = " ".join(pbs_server.hpclaunch("status", str(bad2), cwd=chains["work"]).stdout.split())
    assert "never runs" in shown
