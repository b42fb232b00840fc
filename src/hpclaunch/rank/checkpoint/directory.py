"""Rank 0's view of the checkpoint directory: which checkpoints are valid, what to load, what to prune.

Runs on the coordinating rank only (the ``Checkpointer`` broadcasts its verdicts). Validity is
verified in full (sizes and sha256 against the manifest) once per process and then trusted while a
directory's files keep their sizes and modification times. A published checkpoint found invalid
(on resume, before a save of the same step, or by retention) is renamed ``step_N.corrupt`` and
recorded as ``checkpoint_invalid`` with the reason: it no longer exists for resume, the step is
saved again when the run recomputes it, and retention never counts it among the ones it keeps.
Torch-free.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ...errors import CheckpointError, FilesystemError
from ...fsutil import fsync_dir, take_aside
from ...rundir import CHECKPOINT_INVALID
from ...rundir.checkpoint_manifest import (
    RANK_LOCAL,
    CheckpointInfo,
    InvalidCheckpoint,
    file_signature,
    leftover_dirs,
    leftover_reason,
    move_aside_corrupt,
    newest_valid,
    published_dirs,
    step_dir_name,
    steps_to_delete,
    verify_checkpoint,
)

log = logging.getLogger("hpclaunch.rank.checkpoint")


# A ledger event as a writer found it (name, fields): appended to the ledger by the training process.
Finding = tuple[str, dict[str, Any]]


class EventSink(Protocol):
    """Where findings go: the run's ``Ledger``, or in the writer process a buffer that the training
    process appends to the ledger when the save's result comes back."""

    def append(self, event: str, **fields: Any) -> Any: ...


class EventBuffer:
    """An ``EventSink`` that keeps what it is given, for someone else to append."""

    def __init__(self) -> None:
        self.events: list[Finding] = []

    def append(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))

    def drain(self) -> list[Finding]:
        out, self.events = self.events, []
        return out


@dataclass(frozen=True)
class Choice:
    """Rank 0's answer to "which checkpoint do we load?", broadcast to every rank as JSON."""

    info: CheckpointInfo | None = None  # None: no valid checkpoint (or an error)
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # newer ones found invalid, why
    error: str | None = None
    filesystem: bool = False  # the error is the filesystem's now, not a verdict on a checkpoint

    def to_json(self) -> dict[str, object]:
        if self.error is not None:
            return {"error": self.error, **({"filesystem": True} if self.filesystem else {})}
        if self.info is None:
            return {"step": None}
        return {
            "step": self.info.step,
            "name": self.info.path.name,
            "manifest": self.info.manifest,
            "skipped": [[str(p), r] for p, r in self.skipped],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], directory: Path) -> Choice:
        if data.get("error"):
            return cls(error=data["error"], filesystem=bool(data.get("filesystem")))
        if data.get("step") is None:
            return cls()
        info = CheckpointInfo(
            step=int(data["step"]), path=directory / data["name"], manifest=data["manifest"]
        )
        return cls(info, [(Path(p), reason) for p, reason in data["skipped"]])


@dataclass(frozen=True)
class RunCheckpoints:
    """The checkpoints of one run as every part that saves or loads them must agree on: where they
    are, the world that saves them and the hashes a resume must match (``check_compatible``), and how many
    retention keeps. The Checkpointer, its writers (in a writer process, from ``WriterSpec``) and
    rank 0's ``CheckpointDir`` take it whole, so none of them can be handed a different set."""

    directory: Path
    world_size: int
    config_hash: str
    model_hash: str
    keep_last: int
    keep_every: int | None = None
    # Older model hashes of the same shapes that a resume accepts too (RunConfig.model_hashes_accepted)
    model_hashes_before: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise CheckpointError(f"keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise CheckpointError(f"keep_every must be >= 1 or None, got {self.keep_every}")

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "directory": str(self.directory)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunCheckpoints:
        before = tuple(data.get("model_hashes_before", ()))
        return cls(**{**data, "directory": Path(data["directory"]), "model_hashes_before": before})


class CheckpointDir:
    def __init__(self, run: RunCheckpoints, *, ledger: EventSink | None) -> None:
        self.run = run
        self.directory = run.directory  # (read on every scan: a short name for it)
        self.ledger = ledger
        # Published checkpoints known to be valid, with their files' signature when verified.
        self._known_valid: dict[int, tuple[tuple[str, int, int], ...]] = {}

    def mark_valid(self, step: int, path: Path) -> None:
        """``path`` was just published by this process (its digests were computed while writing)."""
        self._known_valid[step] = file_signature(path)

    def is_valid(self, step: int, path: Path) -> bool:
        """Rank 0: is published ``path`` valid? Verified in full once per process (then trusted
        while its files are unchanged); an invalid one is moved aside as ``.corrupt`` and reported."""
        try:
            signature = file_signature(path)
            if self._known_valid.get(step) == signature:
                return True
            verify_checkpoint(path)
            self._known_valid[step] = signature
            return True
        except InvalidCheckpoint as e:
            self.set_aside(path, str(e))
        except FileNotFoundError:
            pass
        except (FilesystemError, OSError) as e:
            # Cannot read it now: not evidence against it. Kept (and counted) as it is.
            log.warning("checkpoint %s cannot be verified now: %s", path.name, e)
            return True
        self._known_valid.pop(step, None)
        return False

    def set_aside(self, path: Path, reason: str) -> None:
        try:
            moved = move_aside_corrupt(path)
            fsync_dir(self.directory)
        except OSError as e:
            log.warning("checkpoint %s is invalid (%s) and cannot be moved aside: %s", path.name, reason, e)
            return
        self.report_invalid(path, reason, moved)

    def apply_retention(self, *, protect: set[int], loading: set[int]) -> None:
        """Keep the newest ``keep_last`` *valid* checkpoints (an invalid one met on the way is moved
        aside, never counted), every ``keep_every``-th and ``protect``; delete the rest."""
        valid: list[int] = []
        for step, path in reversed(published_dirs(self.directory)):
            if len(valid) >= self.run.keep_last:
                break
            if step in protect or self.is_valid(step, path):
                valid.append(step)
        steps = [s for s, _ in published_dirs(self.directory)]
        doomed = steps_to_delete(
            steps,
            keep_last=0,
            keep_every=self.run.keep_every,
            protect=protect | loading | set(valid),
        )
        for step in doomed:
            self.delete(self.directory / step_dir_name(step))

    def delete(self, path: Path) -> None:
        """Rename first so that a kill mid-delete leaves a leftover, never a broken step_N."""
        aside = self.directory / f".{path.name}.del-{uuid.uuid4().hex[:12]}"
        if not take_aside(path, aside):
            return
        fsync_dir(self.directory)
        shutil.rmtree(aside, ignore_errors=True)
        self._known_valid.pop(int(path.name.split("_")[1]), None)
        log.info("retention: deleted checkpoint %s", path.name)

    def choose(self) -> Choice:
        """Rank 0: the checkpoint to load (errors included, for the broadcast). Checks the
        structure and sizes; the sha256 of its files is checked by every rank, a share each
        (``loading.load_latest``). A checkpoint that cannot be read now is never set aside:
        the answer is a filesystem error (the attempt fails and is retried like a crash)."""
        try:
            leftovers = self.remove_leftovers()
            info, skipped = newest_valid(self.directory, verify_hashes=False)
            for path, reason in skipped:
                self.set_aside(path, reason)  # so the run saves those steps again
            for _, path, reason in leftovers:
                self.report_invalid(path, reason)
            if info is not None:
                self._known_valid[info.step] = file_signature(info.path)
            chosen = info.step if info else -1
            skipped += [(p, reason) for step, p, reason in leftovers if step > chosen]
            if info is None:
                log.info("no valid checkpoint in %s; starting fresh", self.directory)
                return Choice()
            self.check_compatible(info)
            log.info("resuming from checkpoint %s", info.path.name)
            return Choice(info, skipped)
        except FilesystemError as e:
            return Choice(error=e.one_line(), filesystem=True)
        except CheckpointError as e:
            return Choice(error=e.one_line())
        except OSError as e:
            return Choice(error=f"reading {self.directory} failed: {e}", filesystem=True)
        except Exception as e:
            return Choice(error=f"choosing a checkpoint in {self.directory} failed: {type(e).__name__}: {e}")

    def remove_leftovers(self) -> list[tuple[int, Path, str]]:
        """Delete unpublished / half-deleted directories of killed writers; return what they were."""
        removed = []
        for step, path in leftover_dirs(self.directory):
            reason = f"{leftover_reason(path)}; removed"
            if ".del-" in path.name:
                log.info("removing %s (%s)", path.name, reason)
            else:
                removed.append((step, path, reason))
            shutil.rmtree(path, ignore_errors=True)
        if removed:
            fsync_dir(self.directory)
        return removed

    def report_invalid(self, path: Path, reason: str, moved: Path | None = None) -> None:
        aside = f"; moved aside to {moved.name}" if moved else ""
        log.warning("skipping checkpoint %s: %s%s", path.name, reason, aside)
        if self.ledger is not None:
            extra = {"moved_to": str(moved)} if moved else {}
            self.ledger.append(CHECKPOINT_INVALID, path=str(path), reason=reason, **extra)

    def check_compatible(self, info: CheckpointInfo) -> None:
        theirs = info.manifest.get("model_hash")
        if theirs != self.run.model_hash and theirs not in self.run.model_hashes_before:
            raise CheckpointError(
                f"checkpoint {info.path.name} was written for a different model shape "
                f"(model_hash {theirs} != {self.run.model_hash}: model.depth/dim_* or another shape "
                "setting changed); start a new run or restore the old model config"
            )
        if info.manifest.get("config_hash") != self.run.config_hash:
            log.info(
                "checkpoint %s was written with a different config (non-shape settings changed)",
                info.path.name,
            )
        saved_world = info.manifest.get("world_size")
        if saved_world != self.run.world_size:
            log.info(
                "checkpoint %s was written by %s ranks, this run has %s",
                info.path.name,
                saved_world,
                self.run.world_size,
            )

    def report_rank_local(self, info: CheckpointInfo, saved: set[int], missing: list[int]) -> None:
        if missing and saved:
            log.warning(
                "checkpoint %s has no %s state for rank(s) %s; they keep their freshly seeded state",
                info.path.name,
                RANK_LOCAL,
                ",".join(map(str, missing)),
            )
        unused = sorted(r for r in saved if r >= self.run.world_size)
        if unused:
            log.info(
                "checkpoint %s: saved %s state of rank(s) %s is not used by %d ranks",
                info.path.name,
                RANK_LOCAL,
                ",".join(map(str, unused)),
                self.run.world_size,
            )
