"""Loading one chosen checkpoint into a state dict through DCP's safe reader and planner.

Used by the ``Checkpointer`` (collective, every rank) and by readers outside training
(``hpclaunch sample``: one process, read-only: it never removes, moves or prunes anything, since a
run may be writing into the same directory). DCP reshards on load: a checkpoint written by N ranks
under DDP or FSDP loads into any number of ranks under either.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointError, UserInputError
from ...rundir.checkpoint_manifest import (
    METADATA_NAME,
    RANK_LOCAL,
    CheckpointInfo,
    InvalidCheckpoint,
    _ranks_with_rank_local,
    published_dirs,
    step_dir_name,
    verify_checkpoint,
)
from ..dist import all_gather_json
from .safe_load import load_metadata_safely, safe_load_parts
from .save_errors import as_checkpoint_error

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("hpclaunch.rank.checkpoint")


def read_metadata_everywhere(path: Path, pg: dist.ProcessGroup | None) -> Any:
    """Every rank reads .metadata safely; if any rank cannot, all raise (no rank is left waiting
    in a DCP collective)."""
    from torch.distributed.checkpoint.metadata import Metadata

    metadata, error = None, None
    try:
        metadata = load_metadata_safely(path / METADATA_NAME)
        if not isinstance(metadata, Metadata):
            raise CheckpointError("is not DCP metadata", where=str(path / METADATA_NAME))
    except CheckpointError as e:
        error = e
    errors = [msg for msg in all_gather_json(error and error.one_line(), pg) if msg]
    if error is not None:
        raise error
    if errors:
        raise CheckpointError(f"another rank cannot read the checkpoint: {errors[0]}")
    return metadata


def dcp_load(
    info: CheckpointInfo, state: dict[str, Any], pg: dist.ProcessGroup | None
) -> tuple[set[int], set[str]]:
    """Load ``info`` into ``state`` in place (collective over ``pg``); return the ranks that have a
    saved RANK_LOCAL entry and the checkpoint's top-level sections."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    parts = safe_load_parts()
    reader = parts.reader(info.path, read_metadata_everywhere(info.path, pg))
    planner = parts.planner(reader, info.path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=pg, no_dist=pg is None)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        raise as_checkpoint_error(e, f"loading {info.path.name}", info.path) from e
    sections = {k.split(".", 1)[0] for k in planner.saved_keys}
    return _ranks_with_rank_local(planner.saved_keys), sections


def load_readonly(
    directory: Path, state: dict[str, Any], *, step: int | None = None
) -> tuple[CheckpointInfo, set[str]]:
    """One process: verify and load checkpoint ``step`` (None: the newest valid one) of
    ``directory`` into ``state``; return it and its sections. Changes nothing on disk."""
    if step is not None:
        path = directory / step_dir_name(step)
        if not path.is_dir():
            have = ", ".join(str(s) for s, _ in published_dirs(directory)) or "none"
            raise UserInputError(
                f"no checkpoint of step {step} (published steps: {have})", where=str(directory)
            )
        try:
            info = verify_checkpoint(path)
        except InvalidCheckpoint as e:
            raise CheckpointError(f"checkpoint of step {step} is not valid: {e}", where=str(path)) from None
    else:
        info = None
        for _, path in reversed(published_dirs(directory)):
            try:
                info = verify_checkpoint(path)
                break
            except InvalidCheckpoint as e:
                log.warning("skipping checkpoint %s: %s", path.name, e)
        if info is None:
            raise UserInputError(
                "no valid checkpoint to sample from", where=str(directory), hint="train the run first"
            )
    assert info is not None
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
    state = {k: v for k, v in state.items() if k != RANK_LOCAL}
    _, sections = dcp_load(info, state, None)
    return info, sections
