"""The MMDiT trainer's distributed set-up for one rank: the process group, the device, deterministic
kernels, wrapping the model for data parallelism (DDP or FSDP2).

``setup_distributed`` joins the group the rank host describes (NCCL on GPUs, gloo on CPU, plus a
gloo group for host-side collectives when the training backend is NCCL) or runs as a single
process. ``wrap_model`` applies activation checkpointing and ``torch.compile`` per MMDiT block,
then DDP, or FSDP2 per block and on the root. What any rank knows of its place among the ranks
(``DistContext``) and the JSON collectives are the rank package's (``rank.dist``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...config import RunConfig
from ...errors import TrainingError
from ...rank.dist import DistContext

if TYPE_CHECKING:
    import torch


def set_deterministic(*, compile: bool = False, deterministic: bool = True) -> None:
    """The kernel mode of ``train.deterministic``.

    Deterministic (the default): deterministic kernels where torch has them (warn where it has none,
    e.g. some SDPA paths), cuDNN without autotuning, TF32 off, a fixed cuBLAS workspace: the same
    run twice, or stopped and resumed, gives bitwise-equal weights. Fast: torch's fastest kernels
    (TF32 for fp32 matmuls, cuDNN autotuning, the flash/efficient attention backward, whose
    accumulation order varies); the stop protocol's exactness (the same samples and random draws at
    every step) holds in both modes, bitwise-equal weights only in the deterministic one.

    ``torch.use_deterministic_algorithms`` imports torch's inductor (seconds on every rank start,
    only to set inductor's own flag); without ``train.compile`` the kernel flag alone is set."""
    import torch

    # SDPA's fused kernels (flash, memory-efficient, cuDNN) accumulate the backward in an order that
    # varies; the deterministic mode computes attention with SDPA's math backend instead.
    for enable in (
        torch.backends.cuda.enable_flash_sdp,
        torch.backends.cuda.enable_mem_efficient_sdp,
        torch.backends.cuda.enable_cudnn_sdp,
    ):
        enable(not deterministic)
    if not deterministic:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    if compile:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch._C._set_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def setup_distributed(cfg: RunConfig) -> DistContext:
    """Join the process group the environment describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``:
    as the rank host, or a plain torchrun, sets them), if any, and pick this rank's device."""
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
    backend = cfg.backend
    device_id = device if backend == "nccl" else None  # None: init_process_group's default
    if "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        if not dist.is_initialized():  # (a caller such as a benchmark may have joined it already)
            dist.init_process_group(backend=backend, device_id=device_id)
        ctx.initialized = True
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
    elif world != 1:  # (one process alone needs no group: it trains unwrapped, see wrap_model)
        raise TrainingError(
            f"WORLD_SIZE={world} but MASTER_ADDR is not set", hint="start ranks with torchrun"
        )
    if ctx.initialized and backend == "nccl":
        # NCCL reduces CUDA tensors only: the stop flag, the save agreements and other host-side
        # collectives go through a gloo group over the same ranks.
        ctx.cpu_group = dist.new_group(backend="gloo")
    # The global batch is what the math depends on; the rank count may differ from the config's
    # (a resume on fewer nodes) as long as it divides the global batch.
    if cfg.train.global_batch % ctx.world_size:
        raise TrainingError(
            f"train.global_batch={cfg.train.global_batch} is not divisible by the {ctx.world_size} ranks "
            "this attempt started",
            hint="choose a global batch divisible by every rank count the run may use",
        )
    shard = cfg.train.fsdp_shard_size
    if cfg.train.parallel == "fsdp" and shard is not None and ctx.world_size % shard:
        raise TrainingError(
            f"train.fsdp_shard_size={shard} does not divide the {ctx.world_size} ranks this attempt started",
            hint="choose a shard size that divides every rank count the run may use (e.g. GPUs per node)",
        )
    return ctx


# ---- data parallelism ----------------------------------------------------------------------------


def device_kind(device: torch.device) -> str:
    """What compiled code depends on: the GPU's name and compute capability, or the CPU."""
    if device.type != "cuda":
        return device.type
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}-sm{major}{minor}"


def wants_bf16(cfg: RunConfig, device: torch.device) -> bool:
    p = cfg.train.precision
    return p == "bf16" or (p == "auto" and device.type == "cuda")


def wrap_model(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext) -> torch.nn.Module:
    """The module the training step calls: ``model`` (changed in place) under DDP or FSDP2.

    Per MMDiT block (``model.trunk.blocks``), in this order: activation checkpointing (the block's
    activations are recomputed in the backward), ``torch.compile``, FSDP2 (one all-gather and one
    reduce-scatter per block). FSDP2 then wraps the root (embeddings, time MLP, heads). On bf16 FSDP
    keeps fp32 sharded weights and optimizer state and computes in bf16 with fp32 gradient
    reduction; on CPU everything stays fp32. Under DDP bf16 is autocast (the loop's business).

    One rank (a single GPU, a CPU run) gets no wrapper, whatever ``train.parallel`` says, as in
    torchtitan: a one-rank FSDP2 copies every parameter into its "gathered" buffer at every
    forward and views and adds every gradient back (per parameter: ~560 host ops a micro-batch for
    280 parameters) and runs the optimizer through DTensor's dispatch; a one-rank DDP copies the
    gradients into buckets. Neither has anything to share. The checkpoints stay interchangeable
    (DCP reshards plain tensors to and from FSDP's shards), and bf16 is then autocast as for DDP.
    """
    t = cfg.train
    blocks: Any = model.trunk.blocks  # type: ignore[union-attr]
    if not t.deterministic:  # the fast mode: the joint attention as one fused SDPA kernel
        from ..model.attention import use_sdpa_attention

        use_sdpa_attention(model)
    if t.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    if t.compile:
        for block in blocks:
            block.compile()
    if ctx.world_size == 1:
        return model
    if t.parallel == "fsdp":
        return fully_shard_model(model, cfg, ctx)
    if ctx.initialized:
        from torch.nn.parallel import DistributedDataParallel as DDP

        cuda = ctx.device.type == "cuda"
        return DDP(
            model,
            device_ids=[ctx.device] if cuda else None,
            # the clean side's last-block branches feed only its (unused) head in l2t/t2l
            find_unused_parameters=t.mode != "joint",
        )
    return model


def fully_shard_model(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext) -> torch.nn.Module:
    """FSDP2 over the ranks (``wrap_model`` calls it from two ranks on): each MMDiT block, then the
    root; with bf16 FSDP's mixed-precision policy."""
    import warnings

    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    t = cfg.train
    blocks: Any = model.trunk.blocks  # type: ignore[union-attr]
    # The heads' outputs are views (a 3-D Linear); the objective only reads them out of place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

    mesh = _fsdp_mesh(ctx, t.fsdp_shard_size)
    mp = MixedPrecisionPolicy()
    if wants_bf16(cfg, ctx.device):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # A block's weights are freed after its forward and gathered again for its backward, except
    # the last block's (its backward comes next) and on a one-rank shard group (HSDP with
    # ``fsdp_shard_size: 1``), where the "gathered" copy is the only compute-dtype one and
    # regathering it is pure overhead.
    sharded = mesh["shard"].size() > 1
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=sharded and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _fsdp_mesh(ctx: DistContext, shard_size: int | None) -> Any:
    """1-D mesh over all ranks, or 2-D (replicate, shard) for HSDP with ``shard_size`` ranks per shard group."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = ctx.device.type
    if shard_size is None or shard_size == ctx.world_size:
        return init_device_mesh(kind, (ctx.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        kind, (ctx.world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def reshard(model: torch.nn.Module) -> None:
    """Free every unsharded FSDP parameter (before weights are swapped in place); no-op without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
