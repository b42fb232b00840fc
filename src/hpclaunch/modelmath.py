"""The model's arithmetic from its config alone (no torch): parameters, FLOPs, the GPUs' peaks.

Torch-free so that preflight (before anything runs), the trainer (TFLOP/s and MFU in its metrics)
and the benchmarks count with one formula. ``estimate_parameters`` counts the layers of
``trainer.model.mmdit_diffusion.MMDiTDiffusion``: it matched the built model exactly when written (plain residual;
mmdit's hyper-connection streams add about 1 %); the probe counts the real model where it can.
"""

from __future__ import annotations

from .config import ModelConfig

# Dense bf16 tensor-core peak per GPU, TFLOP/s (vendor data sheets, SXM parts; the figures twice as
# high on some sheets are with 2:4 sparsity). Matched against the device name, first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (``torch.cuda.get_device_name``); None: unknown."""
    return next((v for k, v in PEAK_BF16_TFLOPS if k in device_name), None)


def stream_parameters(m: ModelConfig, d: int) -> int:
    """Parameters of one modality of width ``d`` inside one MMDiT block."""
    dc, inner = m.dim_cond, m.heads * m.dim_head
    adaln = 2 * (dc * 2 * d + 2 * d)  # attention and feed-forward AdaLN (gamma, beta)
    attn = d * 3 * inner + inner * d  # qkv and out projections, no bias
    ff = d * 4 * d + 4 * d + 4 * d * d + d
    return adaln + attn + ff


def estimate_parameters(m: ModelConfig) -> int:
    """Parameters of ``trainer.model.mmdit_diffusion.MMDiTDiffusion`` for ``m`` by formula (see module doc)."""
    dt, dl, dc = m.dim_text, m.dim_latent, m.dim_cond

    def stream(d: int) -> int:
        return stream_parameters(m, d)

    block = dc * 2 * (dt + dl) + 2 * (dt + dl) + stream(dt) + stream(dl)  # + post-branch gammas
    trunk = m.depth * block + dt + dl  # + final norms
    embed = (m.vocab_size + 1) * dt + m.text_len * dt + m.latent_dim * dl + dl + m.latent_len * dl
    time = 2 * dc * dc + dc + dc * dc + dc
    heads = dt * m.vocab_size + m.vocab_size + dl * m.latent_dim + m.latent_dim
    return trunk + embed + time + heads


def train_flops_per_sample(m: ModelConfig) -> int:
    """Model FLOPs of one training sample (forward + backward = 3 x forward; recomputation by
    activation checkpointing not counted, as MFU conventionally does not).

    Forward, multiply-adds counted as 2: every token passes its own modality's weights in every
    block (``stream_parameters``: MMDiT keeps separate weights per modality), text tokens the text
    head (``dim_text x vocab``), latent tokens the latent projection in and out; attention adds
    ``2 x 2 x N^2 x heads x dim_head`` per block (Q K^T and A V over the joint sequence of
    N = text_len + latent_len tokens). Embedding lookups, norms and the time MLP are left out (small).
    """
    inner = m.heads * m.dim_head
    n = m.text_len + m.latent_len
    per_block = m.text_len * stream_parameters(m, m.dim_text) + m.latent_len * stream_parameters(
        m, m.dim_latent
    )
    heads = m.text_len * m.dim_text * m.vocab_size + m.latent_len * 2 * m.latent_dim * m.dim_latent
    forward = 2 * (m.depth * per_block + heads) + m.depth * 4 * n * n * inner
    return 3 * forward
