"""Sizes the checks reason about before anything runs: parameters, checkpoint bytes, save time.

The exact parameter count comes from the probe (the real model built on the meta device). When the
probe cannot answer, ``estimate_parameters`` counts the same layers by formula: it matched
``trainer.model.build_model`` exactly when written (plain residual; mmdit's hyper-connection streams
add about 1 %), and every figure built on it is labelled as an estimate.
"""

from __future__ import annotations

from ..config import ModelConfig, RunConfig
from ..fsutil import human_bytes as human_bytes  # the checks import it from here

# fp32 weights + AdamW's two moments; DCP metadata, manifest and RNG state are small.
BYTES_PER_PARAM = 4 * 3
CHECKPOINT_OVERHEAD = 1 << 20
# What we assume a checkpoint write sustains before it was ever measured (a busy parallel FS).
ASSUMED_WRITE_BPS = 200e6
# torchrun start, imports, rendezvous, resume: not knowable before a run, so assumed.
ASSUMED_STARTUP_S = 60


def estimate_parameters(m: ModelConfig) -> int:
    """Parameters of ``trainer.model.MMDiTDiffusion`` for ``m`` by formula (see module doc)."""
    dt, dl, dc = m.dim_text, m.dim_latent, m.dim_cond
    inner = m.heads * m.dim_head

    def stream(d: int) -> int:  # one modality inside one MMDiT block
        adaln = 2 * (dc * 2 * d + 2 * d)  # attention and feed-forward AdaLN (gamma, beta)
        attn = d * 3 * inner + inner * d  # qkv and out projections, no bias
        ff = d * 4 * d + 4 * d + 4 * d * d + d
        return adaln + attn + ff

    block = dc * 2 * (dt + dl) + 2 * (dt + dl) + stream(dt) + stream(dl)  # + post-branch gammas
    trunk = m.depth * block + dt + dl  # + final norms
    embed = (m.vocab_size + 1) * dt + m.text_len * dt + m.latent_dim * dl + dl + m.latent_len * dl
    time = 2 * dc * dc + dc + dc * dc + dc
    heads = dt * m.vocab_size + m.vocab_size + dl * m.latent_dim + m.latent_dim
    return trunk + embed + time + heads


def checkpoint_bytes(params: int) -> int:
    return int(params * BYTES_PER_PARAM * 1.01) + CHECKPOINT_OVERHEAD


def kept_checkpoints(cfg: RunConfig) -> int:
    """Checkpoints on disk at the worst moment: keep_last, the one being written, the keep_every ones."""
    c = cfg.checkpoint
    extra = cfg.train.steps // c.keep_every if c.keep_every else 0
    return c.keep_last + 1 + extra


def estimated_save_s(ckpt_bytes: int) -> float:
    return 2.0 + ckpt_bytes / ASSUMED_WRITE_BPS


def human_count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return str(n)
