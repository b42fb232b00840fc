"""The memory tier's configuration, where its snapshots live, and what status makes of a resume."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError
from hpclaunch.orchestrator.status import attempts_from_events
from hpclaunch.rundir import RunPaths, parse_event
from hpclaunch.trainer.memory_tier import SHM_ROOT, snapshot_dir

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
    assert a.parent == b.parent == SHM_ROOT and a != b
    assert snapshot_dir(cfg, RunPaths(tmp_path / "a")) == a  # the same run: the same place, every attempt
    given = load_config(None, ["checkpoint.memory.every_steps=5", f"checkpoint.memory.dir={tmp_path / 'm'}"])
    assert snapshot_dir(given, RunPaths(tmp_path / "a")) == tmp_path / "m"


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
    assert steps_text(Attempt("a1", resumed_step=20, last_step=40, resumed_from="disk")) == "20→40"
    memory = Attempt("a2", resumed_step=35, last_step=90, resumed_from="memory", memory_saved_steps=15)
    assert steps_text(memory) == "35→90 (memory, +15)"
    assert steps_text(memory, " → ") == "35 → 90 (memory, +15)"
