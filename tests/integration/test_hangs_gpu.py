"""GPU only (skipped without CUDA): a hang on an NCCL rank leaves torch's flight record.

The agent sets the flight recorder's variables (buffer, dump on timeout, dump file and trigger pipe
in the attempt's log directory) and, on a hang, writes to the pipe; the rank's NCCL heartbeat
monitor then dumps its recent collectives. One GPU, one rank (an NCCL process group of one under
torchrun), the local scheduler, no hang retries: the run fails with cause hang after the dump.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.runlib import TINY, events, hpclaunch, synth_data, tiny_overrides, wait_run_done


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU (NCCL)")]


def test_a_hang_on_an_nccl_rank_dumps_its_flight_record(tmp_path: Path) -> None:
    data = synth_data(tmp_path / "data")
    overrides = tiny_overrides(
        tmp_path,
        data,
        "gpuhang",
        "scheduler.gpus_per_node=1",
        "scheduler.procs_per_node=1",
        "train.steps=20",
        "train.warmup_steps=5",
        "watchdog.step_min_s=10",
        "watchdog.step_factor=1",
        "watchdog.poll_s=1",
        "scheduler.max_hang_retries=0",
        "testing.hang=[{rank: 0, phase: data, step: 8}]",
    )
    hpclaunch("submit", str(TINY), *overrides, "--no-preflight", cwd=tmp_path)
    run = tmp_path / "runs" / "gpuhang"
    s = wait_run_done(run, tmp_path, timeout=400)
    assert s["state"] == "failed" and s["attempts"][0]["cause"] == "hang", json.dumps(s, indent=1)[-2000:]
    # (the flight recorder's variables are the attempt's, not the preset's: jobs/attempt_env.py)
    assert any(e["event"] == "nccl_preset" for e in events(run))
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert hang["flight_recorder"] == [f"logs/attempt-{hang['attempt']}/nccl/nccl_trace_rank_0"], hang
    assert (run / hang["flight_recorder"][0]).stat().st_size > 0
    assert "in hang_forever" in (run / "logs" / f"attempt-{hang['attempt']}" / "rank0.stacks.txt").read_text()
