"""A rank's progress reporter: the heartbeat file, step-time summaries (own work vs waiting), the
torch.distributed call a blocked main thread is in, and the test knobs that hang or slow a rank."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import pytest

from hpclaunch.config import ConfigError, load_config
from hpclaunch.rank.fault_injection import TestFaults, burn_cpu
from hpclaunch.rank.progress import Progress
from hpclaunch.rundir import RunPaths
from hpclaunch.rundir.progress_files import ProgressRecord, read_progress


def test_heartbeat_and_step_summaries_split_own_work_from_waiting(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path).ensure()
    heartbeat = paths.attempt_dir("j.0") / "rank1.progress.json"
    steptimes = tmp_path / "steptimes" / "rank1.jsonl"
    p = Progress(
        heartbeat, rank=1, attempt="j.0", node="n7", steptimes=steptimes, summary_every=2, every_s=0.05
    )
    p.start()
    try:
        for step in (1, 2, 3, 4):
            t0 = time.perf_counter()
            p.phase("data", step)
            burn_cpu(0.02)  # own work
            p.phase("compute")
            burn_cpu(0.02)
            p.phase("collective")
            time.sleep(0.05)  # waiting for the other ranks: no CPU
            p.stepped(step, time.perf_counter() - t0)
        time.sleep(0.2)
        record = read_progress(paths, "j.0")[1]
        assert (record.node, record.step, record.phase) == ("n7", 4, "collective")
        assert record.last_step_s is not None and record.recent_max_step_s is not None
        assert record.waiting is None
    finally:
        p.close()
    lines = [json.loads(x) for x in steptimes.read_text().splitlines()]
    assert [(x["step"], x["steps"], x["attempt"], x["node"]) for x in lines] == [
        (2, 2, "j.0", "n7"),
        (4, 2, "j.0", "n7"),
    ]
    for x in lines:
        assert x["basis"] == "cpu_time"
        assert 0.035 <= x["work_s"] <= x["step_s"]  # 40 ms of CPU per step
        assert x["wait_s"] >= 0.04  # the 50 ms sleep is waiting, not work
        assert x["collective_s"] >= 0.045 and x["data_s"] >= 0.015
    assert ProgressRecord.from_json(json.loads(heartbeat.read_text())).phase == "done"


def test_a_main_thread_blocked_in_torch_distributed_is_reported_as_waiting(tmp_path: Path) -> None:
    import torch.distributed as dist

    paths = RunPaths(tmp_path).ensure()
    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    box: dict[str, Progress] = {}

    def rank0_alone() -> None:
        box["p"] = Progress(paths.attempt_dir("j.0") / "rank0.progress.json", rank=0, every_s=0.05).start()
        from datetime import timedelta

        with contextlib.suppress(Exception):  # rank 1 never comes: init blocks in c10d until its timeout
            dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=3))

    thread = threading.Thread(target=rank0_alone)
    thread.start()
    try:
        deadline = time.time() + 3
        waiting = None
        while time.time() < deadline and not waiting:
            time.sleep(0.1)
            rec = read_progress(paths, "j.0").get(0)
            waiting = rec.waiting if rec else None
        assert waiting, "the heartbeat never saw the main thread inside torch.distributed"
    finally:
        thread.join(timeout=30)
        box["p"].close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_test_knobs(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "scheduler.procs_per_node=2",
            "train.global_batch=16",
            "testing.hang=[{rank: 1, phase: save, step: 20}, {rank: 0, phase: startup}]",
            "testing.slow_rank={rank: 1, seconds: 0.05}",
        ],
    )
    paths = RunPaths(tmp_path).ensure()
    assert TestFaults.from_config(cfg.testing, paths, 0) is not None
    one = TestFaults.from_config(cfg.testing, paths, 1)
    assert one is not None and one.slow_s == 0.05 and [i for i, _ in one.hangs] == [0]
    cpu = time.thread_time()
    one.on_phase("data", 3)  # slow: burns its CPU seconds once per step
    one.on_phase("compute", 3)
    one.on_phase("data", 3)  # a second micro-batch of the same step: no more
    assert 0.05 <= time.thread_time() - cpu < 0.09
    one.on_phase("save", 19)  # not its step: returns
    assert one._first_time(0) and not one._first_time(0)  # each hang fires once per run
    assert TestFaults.from_config(load_config(None, []).testing, paths, 0) is None


@pytest.mark.parametrize(
    "override,phrase",
    [
        ("testing.hang=[{rank: 2}]", "testing.hang: rank 2 does not exist (world size 1)"),
        ("testing.hang=[{rank: 0, phase: startup, step: 3}]", "startup comes before any step"),
        ("testing.slow_rank={rank: 5, seconds: 1}", "testing.slow_rank: rank 5 does not exist"),
        ("watchdog.step_min_s=1", "watchdog.step_min_s"),
        ("watchdog.stragler_every=3", "did you mean"),
    ],
)
def test_bad_knobs_and_windows_are_refused_at_load(override: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert phrase in err.value.one_line()
