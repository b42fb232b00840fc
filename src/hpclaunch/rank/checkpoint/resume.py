"""Resume: load the newest valid checkpoint of a run into every rank's state (collective).

Rank 0 removes leftovers of killed writers, checks structure and sizes newest-first and tells every
rank which checkpoint to load (``CheckpointDir.choose``, broadcast as JSON); every rank then hashes
a share of its files, so a large checkpoint is verified in the time of its share; one whose sha256
does not match is set aside and the next one tried. The ``Checkpointer`` calls this after waiting
for its background save.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ...errors import CheckpointError, FilesystemError
from ...rundir.checkpoint_manifest import CheckpointInfo, InvalidCheckpoint, LoadResult, verify_share
from ..dist import all_gather_json, broadcast_json
from .directory import CheckpointDir, Choice
from .reader import dcp_load

if TYPE_CHECKING:
    import torch.distributed as dist


class ShareVerdict(TypedDict, total=False):
    """One rank's verdict on its share, gathered as JSON (no key: the share matched)."""

    invalid: str  # a file does not match the manifest
    filesystem: str  # a file cannot be read now


def load_latest(
    state: dict[str, Any],
    *,
    checkpoints: CheckpointDir,
    world_size: int,
    pg: dist.ProcessGroup | None,
    is_coordinator: bool,
    loading: set[int],
) -> LoadResult | None:
    """Load the newest valid checkpoint into ``state`` in place; None when there is none.

    ``loading``: the steps retention must not delete meanwhile (the writer's set)."""
    skipped: list[tuple[Path, str]] = []  # newest first, in the order they were found bad
    while True:
        mine = checkpoints.choose().to_json() if is_coordinator else {}
        choice = Choice.from_json(broadcast_json(mine, pg, is_source=is_coordinator), checkpoints.directory)
        if choice.error:
            raise (FilesystemError if choice.filesystem else CheckpointError)(choice.error)
        if choice.info is None:
            return None
        skipped += choice.skipped
        info = choice.info
        problem = verify_shares(info, pg)
        if problem is None:
            break
        # A file whose sha256 does not match: the checkpoint is set aside, the next one tried.
        if is_coordinator:
            checkpoints.set_aside(info.path, problem)
        skipped.append((info.path, problem))
    if is_coordinator:
        checkpoints.mark_valid(info.step, info.path)
    loading.add(info.step)
    try:
        saved_ranks, sections = dcp_load(info, state, pg)
    finally:
        loading.discard(info.step)
    missing = sorted(set(range(world_size)) - saved_ranks)
    if is_coordinator:
        checkpoints.report_rank_local(info, saved_ranks, missing)
    return LoadResult(info=info, skipped=skipped, ranks_without_rank_local=missing, saved_sections=sections)


def verify_shares(info: CheckpointInfo, pg: dist.ProcessGroup | None) -> str | None:
    """Every rank hashes its share of ``info``'s files (collective): None when all match, else
    the first mismatch. A share that cannot be read now raises FilesystemError on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank(pg) if pg is not None else 0
    world = dist.get_world_size(pg) if pg is not None else 1
    verdicts: list[ShareVerdict] = all_gather_json(_verify_share(info, rank, world), pg)
    unreadable = [v["filesystem"] for v in verdicts if v.get("filesystem")]
    if unreadable:
        raise FilesystemError(unreadable[0])
    invalid = [v["invalid"] for v in verdicts if v.get("invalid")]
    return invalid[0] if invalid else None


def _verify_share(info: CheckpointInfo, rank: int, world: int) -> ShareVerdict:
    try:
        verify_share(info, rank, world)
        return {}
    except InvalidCheckpoint as e:
        return {"invalid": str(e)}
    except FilesystemError as e:
        return {"filesystem": e.one_line()}
