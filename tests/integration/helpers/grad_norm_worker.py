"""One rank of ``test_grad_norm_torchrun``: the global grad norm and clipping of ``trainer.grads`` on
FSDP2 shards against torch's own ``get_total_norm`` / ``clip_grads_with_norm_`` over the DTensors.
Writes one JSON line per mesh layout to ``rank<r>.jsonl`` in its working directory."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hpclaunch.trainer.grads import clip_, local_grads, shard_group, total_norm


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.GELU(), torch.nn.Linear(33, 5))


def main() -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    for layout in ("shard", "replicate"):
        shape, names = ((world,), ("shard",)) if layout == "shard" else ((world, 1), ("replicate", "shard"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        m = model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        torch.manual_seed(1 + rank)  # each rank its own batch
        m(torch.randn(4, 7)).square().sum().backward()
        params = list(m.parameters())
        expected = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
        ours = total_norm(local_grads(params), shard_group(params), torch.device("cpu"))
        clip_(local_grads(params), 0.5, ours)
        clipped = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
        row = {
            "layout": layout,
            "rank": rank,
            "expected": expected.item(),
            "ours": ours.item(),
            "clipped": clipped.item(),
        }
        with open(f"rank{rank}.jsonl", "a") as out:  # one file a rank: their stdouts interleave
            out.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
