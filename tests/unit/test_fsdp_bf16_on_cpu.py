"""bf16 FSDP2 as on a GPU, run on the CPU: the same mixed-precision policy, the same casts.

Config refuses bf16 on CPU ranks (CPU training is fp32), so the policy is forced here: what this
guards is the model's own dtypes under FSDP's mixed precision, which casts parameters and the root
module's inputs to bf16 but not what the forward computes itself in fp32 (the timestep features).
On an H200 that mismatch failed the first step ("mat1 and mat2 must have the same dtype"). Also the
DCP stager's copy of DTensor state (the thread writer's staging), which failed on torch 2.11.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hpclaunch.config import load_config
from hpclaunch.trainer.model.mmdit_diffusion import build_model
from hpclaunch.trainer.model.objective import Objective, compute_losses, draw
from hpclaunch.trainer.setup import parallel as trainer_dist
from hpclaunch.trainer.setup.parallel import DistContext, fully_shard_model, wrap_model

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_bf16_fsdp2_step_computes_in_bf16_and_keeps_fp32_weights(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(TINY, ["train.parallel=fsdp"])
    monkeypatch.setattr(trainer_dist, "wants_bf16", lambda cfg, device: True)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=True)
    model = fully_shard_model(build_model(cfg.model, seed=0), cfg, ctx)  # (one group of one rank)
    m = cfg.model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, m.vocab_size, (4, m.text_len), generator=gen)
    latents = torch.randn(4, m.latent_len, m.latent_dim, generator=gen)
    d = draw(0, 0, [0, 1, 2, 3], m.text_len, (m.latent_len, m.latent_dim))
    seen: list[torch.dtype] = []
    hook = model.time_mlp.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    losses = compute_losses(model, tokens, latents, d, Objective("joint", m.vocab_size, 1.0, 1.0))
    hook.remove()
    losses.total.backward()
    assert seen == [torch.bfloat16]  # the time MLP ran in bf16, fed its own dtype
    assert torch.isfinite(losses.total)
    for p in model.parameters():  # sharded weights and their gradients stay fp32
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_dcp_stager_copies_the_state_of_dtensors(one_rank_group: None) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hpclaunch.rank.checkpoint.background import _stager_copies_classes

    _stager_copies_classes()
    _stager_copies_classes()  # once is enough; twice is harmless
    mesh = init_device_mesh("cpu", (1,))
    state = {"w": distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Shard(0)]), "kind": int}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged = stager.stage(state)
    assert isinstance(staged, dict)
    assert staged["kind"] is int
    assert torch.equal(staged["w"].to_local(), torch.arange(6.0).reshape(2, 3))
    stager.close()


def test_one_rank_trains_the_model_unwrapped_whatever_the_parallelism(one_rank_group: None) -> None:
    """A one-rank FSDP2 or DDP only adds work (per-parameter copies, DTensor dispatch, buckets):
    one rank gets the model itself, with its plain parameters."""
    from torch.distributed.tensor import DTensor

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), initialized=True)
    for parallel in ("fsdp", "ddp"):
        model = build_model(load_config(TINY, [f"train.parallel={parallel}"]).model, seed=0)
        assert wrap_model(model, load_config(TINY, [f"train.parallel={parallel}"]), ctx) is model
        assert not any(isinstance(p, DTensor) for p in model.parameters())
