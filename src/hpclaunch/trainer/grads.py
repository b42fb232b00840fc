"""The global gradient norm and clipping, on this rank's local gradients in a few foreach ops.

``torch.nn.utils.get_total_norm`` over FSDP's DTensor gradients dispatches every op through
DTensor's Python layer and moves one norm per parameter (``.to``), then ``full_tensor()`` reduces
it; on a GPU that is hundreds of small host calls a step that grow with the parameter count. Here:
one ``_foreach_norm`` over the local shards, one norm of those norms and, when the gradients are
sharded, one all-reduce of its square over the ranks that hold the shards (the replicas of HSDP
hold equal gradients and are not summed). Clipping is one ``_foreach_mul_`` by a coefficient that
stays on the device (no host sync).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..rank.tensors import is_dtensor

__all__ = ["clip_", "local_grads", "shard_group", "total_norm"]


def local_grads(params: list[torch.nn.Parameter]) -> list[Tensor]:
    """This rank's part of every gradient present (the shard under FSDP)."""
    out = []
    for p in params:
        g = p.grad
        if g is not None:
            out.append(g._local_tensor if is_dtensor(g) else g)  # type: ignore[attr-defined]
    return out


def shard_group(params: list[torch.nn.Parameter]) -> Any:
    """The process group over which FSDP shards the parameters (None: not sharded, or one rank)."""
    for p in params:
        if is_dtensor(p):
            mesh = p.device_mesh  # type: ignore[attr-defined]
            dim = mesh.mesh_dim_names.index("shard") if mesh.mesh_dim_names else 0
            # (one rank: no group to resolve; a process that made several one-rank groups in turn,
            # as tests do, may hold a mesh whose group name has since been reused)
            return mesh.get_group(dim) if mesh.size(dim) > 1 else None
    return None


def total_norm(grads: list[Tensor], group: Any, device: torch.device) -> Tensor:
    """The 2-norm of all gradients together (fp32, on ``device``); non-finite if any element is."""
    if not grads:
        return torch.zeros((), device=device)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)).float(), 2.0)
    if group is None:
        return norm
    import torch.distributed as dist

    square = norm * norm
    dist.all_reduce(square, group=group)
    return square.sqrt()


def clip_(grads: list[Tensor], max_norm: float, norm: Tensor) -> None:
    """Scale the gradients in place so their global norm is at most ``max_norm`` (as torch's
    ``clip_grads_with_norm_``: by ``max_norm / (norm + 1e-6)`` when that is below 1)."""
    if grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
