"""The memory tier's whole cost and its interval (``rank.snapshots.snapshot_interval``): the cost is the
stall plus the slowdown of the steps a snapshot's job runs beside; ``every_steps: auto`` snapshots
at the Young/Daly interval of that cost and the run's MTBF, decided by rank 0 at snapshot steps."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from tests.unit.tiny_model import tiny_model

from hpclaunch.config import load_config
from hpclaunch.rank.checkpoint.save_interval import young_daly_interval_s
from hpclaunch.rank.checkpoint.staging import SharedStager
from hpclaunch.rank.snapshots.snapshot_interval import PROBE_STEPS, CostMeter, SnapshotSchedule
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.shards import synth_dataset
from hpclaunch.trainer.loop import Trainer

pytestmark = pytest.mark.fast


def test_the_whole_cost_is_the_stall_and_the_slowdown_beside_the_job() -> None:
    meter, now = CostMeter(), 0.0

    def period(dt: float, *, beside: bool) -> None:
        nonlocal now
        meter.period_begins(now, job_in_flight=beside)
        now += dt
        meter.period_ended(now)

    for dt in (9.0, 1.0, 1.0, 1.0):
        period(dt, beside=False)
    assert meter.step_s == 1.0  # the attempt's first period is warm-up
    meter.job_started()  # a snapshot: its job runs beside the next two steps
    period(1.5, beside=True)
    period(1.2, beside=True)
    period(1.0, beside=False)
    assert meter.step_s == 1.0  # the steps beside a job are not steady ones
    beside, whole = meter.job_settled(0.01)
    assert beside == pytest.approx(0.7) and whole == pytest.approx(0.71) and meter.cost_s == whole


def test_auto_measures_first_then_snapshots_at_the_young_daly_interval() -> None:
    sched = SnapshotSchedule(None, mtbf_s=3600.0, start_step=40)
    meter = CostMeter()
    assert [s for s in range(40, 60) if sched.due(s)][:1] == [45]  # the calibration snapshot
    first = sched.propose(45, meter)  # nothing measured: measure this one, decide at the next
    assert first["interval_steps"] == PROBE_STEPS and first["interval_s"] is None
    sched.adopt(first)
    assert not sched.due(54) and sched.due(55)
    sched.postpone(55)  # the disk saves at 55: the snapshot moves to 56 on every rank
    assert not sched.due(55 - 1) and sched.next_step == 56
    for _ in range(5):
        meter.period_begins(0.0, job_in_flight=False)
        meter.period_ended(0.1)
    meter.job_settled(0.02)
    decided = sched.propose(56, meter)
    expect = young_daly_interval_s(0.02, 3600.0)  # 12 s: 120 steps of 0.1 s
    assert decided["interval_s"] == pytest.approx(expect, abs=1e-3)
    assert decided["interval_steps"] == round(expect / 0.1) and decided["next_step"] == 56 + 120
    assert decided["expected_loss_per_failure_s"] == pytest.approx(expect / 2, abs=1e-3)
    fixed = SnapshotSchedule(5, mtbf_s=1.0, start_step=0)
    assert [s for s in range(1, 16) if fixed.due(s)] == [5, 10, 15]


def test_plain_values_are_serialized_once_and_a_changed_one_again() -> None:
    """``torch.save`` of the same betas, indices and RNG tuple at every snapshot held the GIL the
    training thread needs; a value that changes, even only its type, is serialized again."""
    stager = SharedStager()
    first = stager._serialize("betas", (0.9, 0.95))
    assert stager._serialize("betas", (0.9, 0.95)) is first
    assert stager._serialize("betas", (0.9, 0.99)) != first
    one = stager._serialize("flag", (1, 2))
    assert stager._serialize("flag", (True, 2)) != one


@pytest.mark.usefixtures("in_process_trainer")
def test_auto_snapshots_where_rank_0_decided_and_says_why(tmp_path: Path) -> None:
    model = tiny_model(2)
    synth_dataset(
        tmp_path / "data", samples=160, seed=0, model_cfg=load_config(None, model).model, shard_size=64
    )
    (tmp_path / "shm").mkdir()
    cfg = load_config(
        None,
        [
            *model, "scheduler.procs_per_node=1", "train.steps=24", "train.global_batch=8",
            "data.num_workers=0", "preflight.distributed_smoke=false", "checkpoint.every_steps=1000",
            f"data.token_dir={tmp_path / 'data/tokens'}", f"data.latent_dir={tmp_path / 'data/latents'}",
            "checkpoint.memory.every_steps=auto", f"checkpoint.memory.dir={tmp_path / 'shm'}",
            "checkpoint.mtbf_hours=0.0005",  # (1.8 s: a short interval, whatever this machine's speed)
        ],
        base=tmp_path,
    )  # fmt: skip
    paths = RunPaths(tmp_path / "run").ensure()
    tr = Trainer(cfg, paths, echo=False)
    try:
        tr.run()
    finally:
        tr.close()
    events = read_events(paths).events
    decided = [e.record for e in events if e.event == "snapshot_interval"]
    saved = [e.record["step"] for e in events if e.event == "snapshot_saved"]
    assert decided[0]["step"] == 5 and decided[0]["next_step"] == 5 + PROBE_STEPS
    assert decided[1]["step"] == 15 and decided[1]["whole_cost_s"] > 0 and decided[1]["interval_s"] > 0
    assert [d["step"] for d in decided] == saved[: len(decided)]  # each snapshot where it was decided
    for a, b in itertools.pairwise(decided):
        assert b["step"] == a["next_step"]
    first = next(e.record for e in events if e.event == "snapshot_saved")
    assert first["whole_s"] >= first["stall_s"] and first["beside_s"] >= 0
