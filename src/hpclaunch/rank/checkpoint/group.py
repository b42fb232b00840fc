"""The process group of the checkpointer's own collectives (gloo, host-side).

Background saves must never share a group, and so a collective order, with the training loop's
collectives: the checkpointer makes a gloo group of its own unless it is given one. One process
without torch.distributed needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import CheckpointError

if TYPE_CHECKING:
    import torch.distributed as dist


def checkpoint_group(
    given: dist.ProcessGroup | None, *, rank: int, world_size: int
) -> tuple[dist.ProcessGroup | None, bool]:
    """(the group, whether the caller owns it and must destroy it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if world_size != 1 or rank != 0:
            raise CheckpointError(
                f"rank {rank} of {world_size} but torch.distributed is not "
                "initialized; initialize it before creating the Checkpointer"
            )
        _silence_single_process_warning()
        return None, False
    if dist.get_rank() != rank or dist.get_world_size() != world_size:
        raise CheckpointError(
            f"Checkpointer was told rank {rank}/{world_size}, torch.distributed "
            f"says {dist.get_rank()}/{dist.get_world_size()}"
        )
    if given is not None:
        return given, False
    return dist.new_group(backend="gloo"), True


def _silence_single_process_warning() -> None:
    """DCP warns on every call that it is 'assuming single process'; that is what we want."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
