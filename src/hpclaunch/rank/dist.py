"""What a rank knows of its place among the ranks (``DistContext``: rank, world size, device, the
gloo group for host-side collectives) and small JSON collectives (rank 0's verdicts reach the other
ranks as JSON bytes, never pickles).

torch is imported inside the functions: the checkpoint package's torch-free part imports the
collectives by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: _cpu())
    initialized: bool = False
    cpu_group: Any = None  # gloo group for host-side collectives (None = the default group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def host_group(self) -> Any:
        """The gloo group for host-side collectives (None when not distributed)."""
        if not self.initialized:
            return None
        import torch.distributed as dist

        return self.cpu_group if self.cpu_group is not None else dist.group.WORLD


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


# ---- JSON collectives ----------------------------------------------------------------------------


def broadcast_json(obj: Any, pg: dist.ProcessGroup | None, *, is_source: bool) -> Any:
    """Rank 0's ``obj`` on every rank, as JSON bytes over ``pg`` (no pickle)."""
    if pg is None:
        return obj
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode() if is_source else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group=pg, group_src=0)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if is_source
        else torch.empty(int(size.item()), dtype=torch.uint8)
    )
    dist.broadcast(buf, group=pg, group_src=0)
    return json.loads(bytes(buf.tolist()))


def all_gather_json(obj: Any, pg: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (in group-rank order), as JSON bytes over ``pg`` (no pickle)."""
    if pg is None:
        return [obj]
    import torch
    import torch.distributed as dist

    data = json.dumps(obj).encode()
    n = dist.get_world_size(pg)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=pg)
    width = max(int(s.item()) for s in sizes)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, mine, group=pg)
    return [json.loads(bytes(b[: int(s.item())].tolist())) for b, s in zip(bufs, sizes, strict=True)]


def context_now(device: torch.device | None = None) -> DistContext:
    """This rank's context as the script left it: the process group it joined (none: one rank
    alone), and for host-side collectives a gloo group over the same ranks where the group's
    backend is not gloo (NCCL reduces CUDA tensors only). ``device``: the model's, else this local
    rank's GPU where there is one, else the CPU. Collective when it makes the gloo group."""
    import os

    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    if device is None:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    ctx = DistContext(local_rank=local, device=device)
    if dist.is_available() and dist.is_initialized():
        ctx.rank, ctx.world_size, ctx.initialized = dist.get_rank(), dist.get_world_size(), True
        if str(dist.get_backend()).lower() != "gloo":
            ctx.cpu_group = dist.new_group(backend="gloo")
    return ctx
