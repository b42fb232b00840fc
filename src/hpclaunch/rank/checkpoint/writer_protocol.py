"""What a training process and its writer process tell each other, as records, and their JSON.

The rank starts its writer with a ``WriterSpec`` (the writer's argv), hands it the staging buffer's
layout (``staging``'s ``describe``) and then one ``SaveRequest`` per save over the ``channel``; the
writer answers each with ``Saved`` or ``Failed``. The JSON of each record (its keys and their
order) is the wire format; both ends are one installation, so they change together. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .directory import Finding, RunCheckpoints
from .writing import Published, SaveJob


@dataclass(frozen=True)
class WriterSpec:
    """Everything a writer process starts from (``writer_main``'s argument, as JSON)."""

    rank: int
    checkpoints: RunCheckpoints
    nice: int
    idle: bool  # start at SCHED_IDLE (a writer found starved there is replaced at ``nice``)
    write_threads: int
    store: tuple[str, int] | None  # where the writers of several ranks meet (writer_process)
    # Set when a writer is started: its generation (the writers' store prefix), then by
    # WriterProcess the channel's descriptor and the training process's pid.
    generation: str = ""
    fd: int = -1
    parent: int = -1

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "checkpoints": self.checkpoints.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WriterSpec:
        store = data["store"]
        return cls(
            **{
                **data,
                "checkpoints": RunCheckpoints.from_json(data["checkpoints"]),
                "store": (str(store[0]), int(store[1])) if store else None,
            }
        )


@dataclass(frozen=True)
class SaveRequest:
    """One save for the writer: the job, the layout of the staging buffer it was copied into, the
    test hooks as the training process saw them, and the non-tensor values (``torch.save`` bytes,
    base64) by flat key."""

    layout: str
    job: SaveJob
    hooks: dict[str, str | None]
    objects: dict[str, str]

    def to_json(self) -> dict[str, object]:
        return {
            "op": "save",
            "layout": self.layout,
            "job": self.job.to_json(),
            "hooks": self.hooks,
            "objects": self.objects,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SaveRequest:
        return cls(data["layout"], SaveJob.from_json(data["job"]), data.get("hooks", {}), data["objects"])


@dataclass(frozen=True)
class Saved:
    """The writer's answer: the save was written (and on rank 0 published)."""

    step: int
    published: Published | None  # rank 0's
    seconds: float  # the write, start to end
    cpu_s: float | None  # the writer's CPU time for it (bench)
    events: list[Finding] = field(default_factory=list)  # what it found (retention), for the ledger

    def to_json(self) -> dict[str, object]:
        return {
            "op": "saved",
            "step": self.step,
            "published": asdict(self.published) if self.published is not None else None,
            "seconds": self.seconds,
            "cpu_s": self.cpu_s,
            "events": self.events,
        }


@dataclass(frozen=True)
class Failed:
    """The writer's answer: the save failed (or, never sent, the training process found its writer
    dead: ``dead``)."""

    message: str
    step: int | None = None
    where: str | None = None
    hint: str | None = None
    events: list[Finding] = field(default_factory=list)
    dead: bool = False

    def to_json(self) -> dict[str, object]:
        return {
            "op": "failed",
            "step": self.step,
            "message": self.message,
            "where": self.where,
            "hint": self.hint,
            "events": self.events,
        }


Answer = Saved | Failed


def answer_from_json(data: Mapping[str, Any]) -> Answer:
    """The writer's answer as it came over the channel (any answer but "saved" is a failure)."""
    events: list[Finding] = [(name, fields) for name, fields in data.get("events", [])]
    if data.get("op") == "saved":
        published = data.get("published")
        return Saved(
            data["step"],
            Published(**published) if published else None,
            float(data["seconds"]),
            data.get("cpu_s"),
            events,
        )
    return Failed(data["message"], data.get("step"), data.get("where"), data.get("hint"), events)
