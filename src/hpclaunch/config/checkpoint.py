"""Checkpoints: the ``checkpoint`` section (interval, retention, the background writer) and its
``memory`` tier (snapshots in the node's shared memory between disk checkpoints)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from .section_base import _check_absolute, _Section


def _whole_or_auto(v: Any, most: int | None, what: str) -> int | str:
    """``auto``, or a whole number from 1 to ``most`` (no bound: None); else "V is not WHAT"."""
    if v == "auto":
        return "auto"
    text = str(v).strip()
    whole = not isinstance(v, bool) and (isinstance(v, int) or text.isdigit())
    if not whole or int(text) < 1 or (most is not None and int(text) > most):
        raise ValueError(f"{v!r} is not {what}")
    return int(text)


class MemoryTierConfig(_Section):
    every_steps: int | Literal["auto"] | None = Field(
        None,
        description="Snapshot the state into the node's shared memory every this many steps, between "
        "disk checkpoints: a crash or hang restarted in place resumes from the newest complete snapshot "
        "when it is newer than the newest checkpoint on disk; auto = the interval that loses the least "
        "expected time (sqrt(2 x a snapshot's measured whole cost x MTBF), as checkpoint.every_steps: "
        "auto); null = off.",
    )

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_auto_or_off(cls, v: Any) -> int | str | None:
        if v is None:
            return None
        return _whole_or_auto(v, None, "a step count: use a whole number >= 1, auto, or null (off)")

    keep_last: int = Field(2, ge=1, description="Snapshots kept in memory, newest first.")
    replicas: int = Field(
        1,
        ge=0,
        le=1,
        description="Copies of each rank's snapshot kept on another node (its buddy: the same local rank "
        "on the next node), so that a spare replacing a dead node restores from memory too; 0 = none. "
        "On one node there is no other node: nothing is copied.",
    )
    dir: str | None = Field(
        None,
        description="The node's tmpfs the snapshots go to, an absolute path that exists on every node "
        "(never created): under it each user has a private directory, hpclaunch-<uid>/<run id>; "
        "null = /dev/shm.",
    )
    wait_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a snapshot may still be moving when training must wait for it (the next "
        "snapshot, a stop's save), counted from its start; past it the tier steps aside for the rest "
        "of the attempt (a peer is gone or stuck) and the disk tier serves.",
    )

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        return _check_absolute(v, ": name the node's tmpfs, e.g. /dev/shm")


class CheckpointConfig(_Section):
    every_steps: int | Literal["auto"] = Field(
        50,
        description="Periodic (asynchronous) save interval in steps; auto = the interval that loses the "
        "least expected time (Young/Daly: sqrt(2 x measured save cost x MTBF)), from this run's own "
        "measurements and checkpoint.mtbf_hours, recomputed after every save.",
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        le=10080,
        description="Save about every this many minutes instead (steps from the measured step time); "
        "when set, every_steps is not used.",
    )
    mtbf_hours: float = Field(
        5000.0,
        gt=0,
        description="Expected hours between failures of one node, for every_steps: auto; the run's "
        "is this divided by scheduler.nodes, corrected by the failures its ledger has seen.",
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept, newest first.")
    keep_every: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of this."
    )
    async_save: bool = Field(
        True, description="Periodic saves in the background (the stop save is always synchronous)."
    )
    dir: str | None = Field(None, description="Checkpoint directory; null = RUN/checkpoints.")
    writer: Literal["process", "thread"] = Field(
        "process",
        description="Where background saves are written: process (a writer process per rank, fed "
        "through shared memory: no GIL shared with training) or thread (a thread of the training process).",
    )
    writer_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to the background writer (Linux): where every core trains, "
        "its CPU work (copies, hashing) yields to the training step; 0 = same priority as training.",
    )
    write_threads: int | Literal["auto"] = Field(
        "auto",
        description="Threads each rank writes and hashes its checkpoint files with (one file per "
        "thread): auto = the node's cores over its ranks, at most 8; 1 = one file per rank. On an "
        "H200 one thread wrote 18.6 GB at 0.39 GB/s.",
    )
    writer_idle: bool = Field(
        True,
        description="The writer process runs only on CPU time nothing else wants (Linux SCHED_IDLE; "
        "a save then waits for idle time where every core trains; a writer a rank must wait for and "
        "finds starved of CPU is replaced by one at writer_nice); false = at writer_nice.",
    )

    memory: MemoryTierConfig = Field(default_factory=MemoryTierConfig)  # type: ignore[arg-type]

    @field_validator("write_threads", mode="before")
    @classmethod
    def _threads_or_auto(cls, v: Any) -> int | str:
        return _whole_or_auto(v, 64, "a thread count: use a whole number from 1 to 64, or auto")

    @field_validator("every_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, v: Any) -> int | str:
        return _whole_or_auto(v, None, "a step count: use a whole number >= 1, or auto")
