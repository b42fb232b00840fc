"""The memory tier's configuration, where its snapshots live, and what status makes of a resume."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError
from hpclaunch.orchestrator.status import attempts_from_events
from hpclaunch.rank.memory_tier import snapshot_dir
from hpclaunch.rundir import RunPaths, parse_event

pytestmark = pytest.mark.fast


def test_off_by_default_one_replica_and_several_nodes_allowed() -> None:
    assert load_config(None, []).checkpoint.memory.every_steps is None
    assert load_config(None, ["checkpoint.memory.every_steps=5"]).checkpoint.memory.every_steps == 5
    several = ["checkpoint.memory.every_steps=5", "scheduler.kind=slurm", "scheduler.nodes=2"]
    assert load_config(None, several).checkpoint.memory.replicas == 1
    with pytest.raises(ConfigError, match=re.escape("checkpoint.memory.replicas")):
        load_config(None, [*several, "checkpoint.memory.replicas=2"])
    with pytest.raises(ConfigError, match=r"checkpoint\.memory\.every_steps"):
        load_config(None, ["checkpoint.memory.every_steps=0"])


def test_each_run_directory_has_its_own_place_in_shared_memory(tmp_path: Path) -> None:
    cfg = load_config(None, ["checkpoint.memory.every_steps=5"])
    a, b = snapshot_dir(cfg, RunPaths(tmp_path / "a")), snapshot_dir(cfg, RunPaths(tmp_path / "b"))
    assert a.parent == b.parent == Path(f"/dev/shm/hpclaunch-{os.getuid()}") and a != b
    assert snapshot_dir(cfg, RunPaths(tmp_path / "a")) == a  # the same run: the same place, every attempt
    # A given tmpfs holds the user's root too, and each run apart: two runs sharing it deleted each
    # other's snapshots
    given = load_config(None, ["checkpoint.memory.every_steps=5", f"checkpoint.memory.dir={tmp_path / 'm'}"])
    a, b = snapshot_dir(given, RunPaths(tmp_path / "a")), snapshot_dir(given, RunPaths(tmp_path / "b"))
    assert a.parent == b.parent == tmp_path / "m" / f"hpclaunch-{os.getuid()}" and a != b


def test_status_says_which_tier_each_attempt_resumed_from_and_what_memory_saved() -> None:
    def resumed(attempt: str, **fields: object) -> object:
        return parse_event({"event": "resumed", "attempt": attempt, "ts": 1.0, **fields})

    first, second, third = attempts_from_events(
        [
            resumed("a1", step=0, disk_step=None),  # a fresh start: no tier
            resumed("a2", step=35, tier="memory", disk_step=20),
            resumed("a3", step=40, tier="disk", disk_step=40),
        ]  # type: ignore[list-item]
    )
    assert (first.resumed_from, first.memory_saved_steps) == (None, None)
    assert (second.resumed_from, second.memory_saved_steps) == ("memory", 15)
    assert (third.resumed_from, third.memory_saved_steps) == ("disk", None)


def test_the_attempts_table_shows_what_the_memory_tier_saved() -> None:
    from hpclaunch.orchestrator.status import Attempt, steps_text

    assert steps_text(Attempt("a1")) == "-"
    assert steps_text(Attempt("a1", resumed_step=20, last_step=40)) == "20→40"  # the tier off
    # on: which tier served, the disk too (it said nothing of a disk resume)
    assert steps_text(Attempt("a1", resumed_step=20, last_step=40, resumed_from="disk")) == "20→40 (disk)"
    memory = Attempt("a2", resumed_step=35, last_step=90, resumed_from="memory", memory_saved_steps=15)
    assert steps_text(memory) == "35→90 (memory, +15)"
    assert steps_text(memory, " → ") == "35 → 90 (memory, +15)"


def test_status_says_the_tier_is_on_what_it_kept_and_its_first_failure(tmp_path: Path) -> None:
    from hpclaunch.orchestrator.memory_tier_view import describe_memory_tier, memory_tier_view

    paths = RunPaths(tmp_path / "run").ensure()
    off = load_config(None, [])
    paths.config.write_text(off.to_yaml())
    assert describe_memory_tier(memory_tier_view(paths, [])) == []  # off: nothing said
    on = load_config(None, ["checkpoint.memory.every_steps=5"])
    paths.config.write_text(on.to_yaml())
    events = [parse_event({"event": "snapshot_saved", "attempt": "a1", "step": s}) for s in (5, 10)] + [
        parse_event(
            {
                "event": "snapshot_failed",
                "attempt": "a1",
                "step": 15,
                "rank": 1,
                "node_name": "n2",
                "error": "writing the snapshot of step 15: no room ...; training goes on, the disk tier serves",
            }
        ),
        parse_event(
            {
                "event": "resumed",
                "attempt": "a2",
                "step": 10,
                "tier": "disk",
                "disk_step": 10,
                "memory_reason": "no whole snapshot: step 15 misses rank 1's shard on every node left",
            }
        ),
    ]
    lines = describe_memory_tier(memory_tier_view(paths, events))  # type: ignore[arg-type]
    assert lines == [
        "memory tier: on, a snapshot every 5 steps, keep 2, 1 copy on the next node; 2 complete",
        "memory tier: rank 1 on n2 in attempt a1: writing the snapshot of step 15: no room ...; "
        "training goes on, the disk tier serves",
        "memory tier: attempt a2 resumed from the disk: no whole snapshot: step 15 misses rank 1's "
        "shard on every node left",
    ]


def test_status_says_what_auto_chose_and_what_a_snapshot_costs(tmp_path: Path) -> None:
    from hpclaunch.orchestrator.memory_tier_view import describe_memory_tier, memory_tier_view

    paths = RunPaths(tmp_path / "run").ensure()
    paths.config.write_text(load_config(None, ["checkpoint.memory.every_steps=auto"]).to_yaml())
    assert describe_memory_tier(memory_tier_view(paths, [])) == [
        "memory tier: on, a snapshot at an interval still to be measured (auto), keep 2, 1 copy on the "
        "next node; 0 complete"
    ]
    events = [
        parse_event({"event": "snapshot_saved", "step": 5, "stall_s": 0.002, "whole_s": 0.012}),
        parse_event(
            {"event": "snapshot_interval", "step": 15, "next_step": 135, "interval_steps": 120,
             "whole_cost_s": 0.012, "mtbf_s": 1800.0}
        ),
    ]  # fmt: skip
    (line,) = describe_memory_tier(memory_tier_view(paths, events))  # type: ignore[arg-type]
    assert line == (
        "memory tier: on, a snapshot every 120 steps (auto: whole cost 12.0 ms, MTBF 0.5 h), keep 2, "
        "1 copy on the next node; 1 complete, each costing training 12.0 ms (2.0 ms stalled)"
    )
