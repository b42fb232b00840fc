"""Distributed set-up for one rank: the process group, the device, deterministic kernels, and small
JSON collectives (rank 0's verdicts reach the other ranks as JSON bytes, never pickles).

``setup_distributed`` joins the group torchrun describes (NCCL on GPUs, gloo on CPU, plus a gloo
group for host-side collectives when the training backend is NCCL) or runs as a single process.
torch is imported inside the functions: the checkpoint package's torch-free part imports this
module's collectives by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import RunConfig
from ..errors import TrainingError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


def set_deterministic() -> None:
    """Deterministic kernels where torch has them (warn where it has none, e.g. some SDPA paths)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


def setup_distributed(cfg: RunConfig) -> DistContext:
    """Join the process group torchrun describes (if any) and pick this rank's device."""
    import torch
    import torch.distributed as dist

    env = os.environ
    rank, world, local = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))
    if cfg.scheduler.gpus_per_node > 0:
        if not torch.cuda.is_available():
            raise TrainingError(
                f"scheduler.gpus_per_node is {cfg.scheduler.gpus_per_node} but CUDA is not available here",
                hint="run on a GPU node, or set scheduler.gpus_per_node: 0 to train on CPU with gloo",
            )
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    ctx = DistContext(rank=rank, world_size=world, local_rank=local, device=device)
    if "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        backend = cfg.backend
        kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, **kwargs)
        ctx.initialized = True
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
        if backend == "nccl":
            ctx.cpu_group = dist.new_group(backend="gloo")
    elif world != 1:
        raise TrainingError(
            f"WORLD_SIZE={world} but MASTER_ADDR is not set", hint="start ranks with torchrun"
        )
    # The global batch is what the math depends on; the rank count may differ from the config's
    # (a resume on fewer nodes) as long as it divides the global batch.
    if cfg.train.global_batch % ctx.world_size:
        raise TrainingError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by the {ctx.world_size} ranks "
            "this attempt started",
            hint="choose a global batch divisible by every rank count the run may use",
        )
    return ctx


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
