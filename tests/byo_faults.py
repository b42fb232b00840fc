"""The example GPT script (examples/byo/gpt_ddp.py) on a real cluster's three nodes, its faults told
the same way on SLURM (tests/cluster/test_slurm_script.py) and on OpenPBS
(tests/pbs/test_pbs_script_spares.py): one training node and two spares; a rank killed after a
memory-tier snapshot (restarted in place from memory), a rank that hangs at step 30 (its node
replaced by a spare), then every process of the run on that spare (the other spare takes over)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from tests.runlib import ROOT, attempt_ids, events, last_logged_step, rank_on_node, training_node, wait_for

DDP = ROOT / "examples" / "byo" / "gpt_ddp.py"
SMALL = ["--batch", "4", "--block", "16", "--layers", "1", "--d-model", "32", "--workers", "1"]
FAULTY_STEPS = 70
# (with scheduler.kind, procs_per_node=2; its hang and node deaths found within the watchdog's 20 s)
FAULTY = (
    "scheduler.nodes=1", "scheduler.spare_nodes=2", "scheduler.time_limit=00:10:00",
    "testing.step_sleep_s=0.3", "checkpoint.every_steps=10", "checkpoint.memory.every_steps=2",
    "watchdog.step_min_s=20", "watchdog.step_factor=1", "watchdog.poll_s=1",
    "testing.hang=[{rank: 1, phase: data, step: 30}]", "scheduler.max_failure_retries=2",
)  # fmt: skip


def crash_then_hang(run: Path, first: str) -> str:
    """Kills a rank on ``first`` once a snapshot at step 6 or later is saved, and waits until the
    hang at step 30 has moved the run to a spare that trained past step 45: that spare."""
    wait_for(
        lambda: any(e["event"] == "snapshot_saved" and e.get("step", 0) >= 6 for e in events(run)),
        timeout=600,
        poll=0.2,
        what="a snapshot at step 6 or later",
    )
    rank_on_node(run, first).send_signal(signal.SIGKILL)
    wait_for(
        lambda: len(attempt_ids(run)) >= 3 and last_logged_step(run) >= 45,
        timeout=600,
        poll=0.2,
        what="step 45 on a spare",
    )
    spare = training_node(run)
    assert spare != first, spare
    return spare


def assert_recovered(s: dict[str, Any], run: Path, first: str, killed: str) -> None:
    """``status --json`` of the run and its ledger tell the three recoveries, in place, and the end."""
    ends = [(a["end"], a["cause"]) for a in s["attempts"]]
    assert ends == [
        ("restarted in place", "crash"), ("restarted in place", "hang"),
        ("restarted in place", "node_failure"), ("finished", None),
    ], ends  # fmt: skip
    assert s["attempts"][1]["resumed_from"] == "memory", s["attempts"][1]
    hang = next(e for e in events(run) if e["event"] == "hang")
    assert hang["ranks"] == [1] and hang["culprit_node"] == first, hang
    replaced = [e["nodes"] for e in events(run) if e["event"] == "node_replaced"]
    assert replaced == [[first], [killed]], replaced
    assert (s["step"], s["steps"]) == (FAULTY_STEPS, FAULTY_STEPS)
    assert s["step_counts"]["lost_steps"] == 0  # (a fault repeats the steps since the copy it resumed)
