"""Sizes the checks reason about before anything runs: parameters, checkpoint bytes, save time.

The exact parameter count comes from the probe (the real model built on the meta device). When the
probe cannot answer, ``estimate_parameters`` counts the same layers by formula: it matched
``trainer.model.mmdit_diffusion.build_model`` exactly when written (plain residual; mmdit's hyper-connection streams
add about 1 %), and every figure built on it is labelled as an estimate.
"""

from __future__ import annotations

from ..config import ModelConfig, RunConfig
from ..fsutil import human_bytes as human_bytes  # the checks import it from here
from ..modelmath import estimate_parameters as estimate_parameters  # the checks import them from here
from ..modelmath import train_flops_per_sample as train_flops_per_sample

# fp32 weights + AdamW's two moments; DCP metadata, manifest and RNG state are small.
BYTES_PER_PARAM = 4 * 3
CHECKPOINT_OVERHEAD = 1 << 20
# What we assume a checkpoint write sustains before it was ever measured (a busy parallel FS).
ASSUMED_WRITE_BPS = 200e6
# The rank host's start, imports, rendezvous, resume: not knowable before a run, so assumed.
ASSUMED_STARTUP_S = 60


def checkpoint_bytes(params: int, *, ema: bool = False) -> int:
    """fp32 weights, AdamW's two moments and, with ``train.ema_decay``, the EMA's fp32 copy."""
    return int(params * (BYTES_PER_PARAM + (4 if ema else 0)) * 1.01) + CHECKPOINT_OVERHEAD


def run_checkpoint_bytes(cfg: RunConfig, params: int) -> int:
    """One checkpoint of this run: with the EMA's copy when ``train.ema_decay`` is set."""
    return checkpoint_bytes(params, ema=cfg.train.ema_decay is not None)


def kept_checkpoints(cfg: RunConfig) -> int:
    """Checkpoints on disk at the worst moment: keep_last, the one being written, the keep_every ones."""
    c = cfg.checkpoint
    extra = cfg.train.steps // c.keep_every if c.keep_every else 0
    return c.keep_last + 1 + extra


def estimated_save_s(ckpt_bytes: int) -> float:
    return 2.0 + ckpt_bytes / ASSUMED_WRITE_BPS


# A script's state is unknown before its first save (preflight's probe measures it, but the plan
# must not depend on preflight having run): the stop lead assumes this much until a save is measured.
SCRIPT_STATE_BYTES = 10**9


def planned_save_s(cfg: RunConfig) -> float:
    """One save of this run as the plan estimates it (parameters by formula; a script's assumed),
    before any save was measured: the save time in the attempt clock's stop lead (``rundir.clock``)."""
    if cfg.is_script:
        return round(estimated_save_s(SCRIPT_STATE_BYTES), 3)
    return round(estimated_save_s(run_checkpoint_bytes(cfg, estimate_parameters(cfg.model))), 3)


def human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return str(n)


# ---- memory per GPU ------------------------------------------------------------------------------

# CUDA context, NCCL buffers and cuBLAS workspaces, measured at 1-2 GiB per rank on H100s (assumed).
GPU_RUNTIME_BYTES = int(1.5 * (1 << 30))
# The caching allocator's fragmentation on top of what tensors hold (assumed).
FRAGMENTATION = 0.10
# Activation values each MMDiT block keeps for the backward pass, per token of a modality of width
# d (inner = heads x dim_head): the two AdaLN norms and modulations (6 d), q/k/v and the attention
# output and its projection's input (5 inner), the gates and residuals (2 d) and the feed-forward's
# input, hidden pre-activation and activation (d + 4 d + 4 d). Counted, not measured: an estimate.
ACT_PER_D = 17
ACT_PER_INNER = 5


def block_parameters(m: ModelConfig) -> int:
    """Parameters of one MMDiT block (both modalities), by the formula of ``estimate_parameters``."""
    with_one = estimate_parameters(m.model_copy(update={"depth": 1}))
    with_two = estimate_parameters(m.model_copy(update={"depth": 2}))
    return with_two - with_one


class MemoryEstimate:
    """Bytes per GPU of one training rank, by part (see ``estimate_memory``)."""

    PARTS = ("parameters", "gradients", "optimizer", "ema", "fsdp_gathered", "activations", "runtime")

    def __init__(self, **parts: int):
        self.parts = {k: int(parts.get(k, 0)) for k in self.PARTS}

    @property
    def total(self) -> int:
        tensors = sum(v for k, v in self.parts.items() if k != "runtime")
        return int(tensors * (1 + FRAGMENTATION)) + self.parts["runtime"]

    def describe(self) -> str:
        shown = ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in self.parts.items() if v)
        return f"{human_bytes(self.total)} ({shown}, +{FRAGMENTATION:.0%} fragmentation)"


def estimate_memory(cfg: RunConfig, params: int) -> MemoryEstimate:
    """Memory per GPU for ``cfg`` with ``params`` parameters, under its sharding and precision.

    Weights, gradients and AdamW's two moments are fp32 (4 + 4 + 8 bytes a parameter), the EMA 4;
    FSDP divides all four by the shard group (``train.fsdp_shard_size``, else every rank) and adds
    the unsharded blocks in flight (the block computing, the next one prefetched, and one block's
    unsharded gradients, in the compute dtype); DDP keeps everything whole, plus its gradient
    buckets (4 bytes a parameter) and, under bf16 autocast, bf16 copies of the weights; one rank
    trains the model unwrapped: DDP's figures without the buckets. Activations:
    per micro-batch sample, every block keeps ``ACT_PER_D * d + ACT_PER_INNER * inner`` values a
    token of each modality, plus the attention matrix ``2 * heads * N^2`` in the deterministic mode;
    with activation checkpointing only each block's inputs are kept and one block is recomputed at
    a time. The text head's logits, their fp32 copy and their gradient add ``text_len x vocab``
    values of 10 bytes (bf16) a sample.
    """
    m, t, s = cfg.model, cfg.train, cfg.scheduler
    bf16 = t.precision == "bf16" or (t.precision == "auto" and s.gpus_per_node > 0)
    act = 2 if bf16 else 4
    micro = cfg.micro_batch
    block = block_parameters(m)
    one_rank = s.world_size == 1  # the model itself, not wrapped (``trainer.setup.parallel.wrap_model``)
    fsdp = t.parallel == "fsdp" and not one_rank
    shard = (t.fsdp_shard_size or s.world_size) if fsdp else 1
    parts: dict[str, int] = {
        "parameters": 4 * params // shard,
        "gradients": 4 * params // shard,
        "optimizer": 8 * params // shard,
        "ema": (4 * params // shard) if t.ema_decay else 0,
    }
    if fsdp:  # (``trainer.setup.parallel.wrap_model``: a one-rank shard group keeps every block gathered)
        parts["fsdp_gathered"] = block * (2 * act + act) if shard > 1 else params * act + block * act
    else:
        parts["gradients"] += 0 if one_rank else 4 * params  # DDP's gradient buckets
        parts["parameters"] += 2 * params if bf16 else 0  # autocast's bf16 weight copies
    inner = m.heads * m.dim_head
    n = m.text_len + m.latent_len
    per_token = [(m.text_len, m.dim_text), (m.latent_len, m.dim_latent)]
    full_block = sum(tokens * (ACT_PER_D * d + ACT_PER_INNER * inner) for tokens, d in per_token)
    # The fast mode's fused attention keeps one value a query and head; the deterministic mode's
    # math attention (SDPA's math backend, or the package's einsum) the scores and probabilities.
    full_block += m.heads * n if not t.deterministic else 2 * m.heads * n * n
    inputs = sum(tokens * d for tokens, d in per_token) + m.dim_cond
    per_sample = (m.depth * inputs + full_block) if t.activation_checkpointing else m.depth * full_block
    logits_bytes = m.text_len * m.vocab_size * (10 if bf16 else 12)
    parts["activations"] = micro * (per_sample * act + logits_bytes)
    parts["runtime"] = GPU_RUNTIME_BYTES if s.gpus_per_node > 0 else 0
    return MemoryEstimate(**parts)


def largest_micro_batch(cfg: RunConfig, params: int, budget_bytes: int, *, limit: int = 4096) -> int:
    """The largest micro-batch whose ``estimate_memory`` fits ``budget_bytes`` (0: not even one
    sample). Memory grows linearly with the micro-batch, so a bisection over ``1..limit`` finds it."""

    def fits(micro: int) -> bool:
        trial = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch": micro})})
        return estimate_memory(trial, params).total <= budget_bytes

    if not fits(1):
        return 0
    low, high = 1, limit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


# ---- host memory per node --------------------------------------------------------------------------

# What a rank's process holds besides its tensors (the interpreter, torch and its libraries, CUDA's
# host side, DataLoader workers and their prefetched items): assumed.
HOST_RUNTIME_BYTES = 1 << 30


class HostMemoryEstimate:
    """Bytes of host memory per node: ``ranks`` x the parts of one rank (see ``estimate_host_memory``)."""

    PARTS = ("staging", "training", "snapshots", "runtime")

    def __init__(self, ranks: int, **parts: int):
        self.ranks = ranks
        self.parts = {k: int(parts.get(k, 0)) for k in self.PARTS}

    @property
    def per_rank(self) -> int:
        return sum(self.parts.values())

    @property
    def total(self) -> int:
        return self.ranks * self.per_rank

    def describe(self) -> str:
        names = {
            "staging": "staging copy",
            "training": "training state",
            "snapshots": "memory tier",
            "runtime": "runtime (assumed)",
        }
        shown = " + ".join(f"{names[k]} {human_bytes(v)}" for k, v in self.parts.items() if v)
        return f"{human_bytes(self.total)} ({self.ranks} rank(s) x ({shown}))"


def staged_bytes_per_rank(cfg: RunConfig, params: int) -> int:
    """The host copy a background save stages on one rank: its part of the checkpoint (all of it
    under DDP, which saves replicated tensors once but stages them on every rank; its shard under
    FSDP). None without background saves."""
    if not cfg.checkpoint.async_save:
        return 0
    t = cfg.train
    shard = (t.fsdp_shard_size or cfg.scheduler.world_size) if t.parallel == "fsdp" else 1
    return run_checkpoint_bytes(cfg, params) // shard


def snapshot_shard_bytes(cfg: RunConfig, params: int) -> int:
    """One rank's snapshot (rank-local: under DDP every rank's holds the whole state, under FSDP its
    shard); 0 when the memory tier is off."""
    if cfg.checkpoint.memory.every_steps is None:
        return 0
    t = cfg.train
    shard = (t.fsdp_shard_size or cfg.scheduler.world_size) if t.parallel == "fsdp" else 1
    return run_checkpoint_bytes(cfg, params) // shard


def snapshot_tmpfs_bytes_per_rank(cfg: RunConfig, params: int) -> int:
    """What the node's tmpfs holds for one rank: ``keep_last`` snapshots and the one being written,
    its own and, on several nodes, its ward's copies (``replicas``)."""
    m = cfg.checkpoint.memory
    kept = 1 + (m.replicas if cfg.scheduler.nodes > 1 else 0)
    return snapshot_shard_bytes(cfg, params) * (m.keep_last + 1) * kept


def snapshot_bytes_per_rank(cfg: RunConfig, params: int) -> int:
    """The memory tier on one rank, in host memory: its part of the tmpfs (``snapshot_tmpfs_bytes_per_rank``),
    and one shard more: its staging copy while training, or, at a restore, the one shard it receives
    (a spare's rank; a sender sends from the tmpfs's own pages). Never both at once: the staging
    buffer is made at the first snapshot after the restore. None when off."""
    return snapshot_shard_bytes(cfg, params) + snapshot_tmpfs_bytes_per_rank(cfg, params)


def estimate_host_memory(cfg: RunConfig, params: int) -> HostMemoryEstimate:
    """Host memory one node needs: per rank the staging copy of a background save (pinned on GPUs),
    on CPU ranks also the training state itself (``estimate_memory``), and the process's runtime."""
    s = cfg.scheduler
    training = estimate_memory(cfg, params).total if s.gpus_per_node == 0 else 0
    return HostMemoryEstimate(
        s.nprocs,
        staging=staged_bytes_per_rank(cfg, params),
        training=training,
        snapshots=snapshot_bytes_per_rank(cfg, params),
        runtime=HOST_RUNTIME_BYTES,
    )
