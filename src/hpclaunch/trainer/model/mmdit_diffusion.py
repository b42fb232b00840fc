"""The MMDiT over text tokens and continuous latents, built around the ``mmdit`` package's trunk.

``mmdit.mmdit_generalized_pytorch.MMDiT`` is only the transformer trunk (joint attention, AdaLN,
per-modality feed-forwards). This module supplies what it lacks:

- text in: token embedding over ``vocab_size + 1`` ids (the last id, ``vocab_size``, is [MASK])
  plus learned positions;
- latents in: a linear projection ``latent_dim -> dim_latent`` plus learned positions;
- time: the two diffusion times (text ``t_text``, latents ``t_latent``; independent in joint mode)
  each get a sinusoidal embedding; the two are *concatenated* and an MLP maps them to ``dim_cond``,
  the single ``time_cond`` the trunk accepts. Concatenation (not a sum) keeps the two times
  distinguishable, which the model needs when one side is clean (t = 0) and the other is not;
- heads: text -> logits over ``vocab_size`` (never the mask id), latents -> ``latent_dim``.

The package's ``qk_rmsnorm`` flag is silently ignored by it (mechanics F4), so it is not exposed.
Its initialisation draws from Python ``random``; ``build_model`` seeds both ``random`` and torch
inside a scope that restores the caller's RNG states, so a model is a pure function of
(config, seed) and building one has no side effects.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ...config import ModelConfig


class TimestepEmbedding(nn.Module):
    """Sinusoidal features of t in [0, 1] (scaled by 1000, as in DiT) followed by nothing: the
    MLP that mixes both times lives in the model."""

    freqs: Tensor

    def __init__(self, dim: int, max_period: float = 10000.0):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.dim = dim

    def forward(self, t: Tensor) -> Tensor:
        args = (t.float() * 1000.0)[:, None] * self.freqs[None, :]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if self.dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb


class MMDiTDiffusion(nn.Module):
    """Text tokens + latents in, text logits + latent velocity (noise - x0) out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from mmdit.mmdit_generalized_pytorch import MMDiT

        self.vocab_size = cfg.vocab_size
        self.mask_id = cfg.vocab_size
        self.text_len = cfg.text_len
        self.latent_len = cfg.latent_len
        self.latent_dim = cfg.latent_dim

        self.token_emb = nn.Embedding(cfg.vocab_size + 1, cfg.dim_text)
        self.text_pos = nn.Parameter(torch.empty(cfg.text_len, cfg.dim_text))
        self.latent_in = nn.Linear(cfg.latent_dim, cfg.dim_latent)
        self.latent_pos = nn.Parameter(torch.empty(cfg.latent_len, cfg.dim_latent))

        self.time_text = TimestepEmbedding(cfg.dim_cond)
        self.time_latent = TimestepEmbedding(cfg.dim_cond)
        self.time_mlp = nn.Sequential(
            nn.Linear(2 * cfg.dim_cond, cfg.dim_cond), nn.SiLU(), nn.Linear(cfg.dim_cond, cfg.dim_cond)
        )

        self.trunk = MMDiT(
            depth=cfg.depth,
            dim_modalities=(cfg.dim_text, cfg.dim_latent),
            dim_cond=cfg.dim_cond,
            heads=cfg.heads,
            dim_head=cfg.dim_head,
            num_residual_streams=cfg.num_residual_streams,
            flash_attn=cfg.flash_attn,
        )

        self.text_head = nn.Linear(cfg.dim_text, cfg.vocab_size)
        self.latent_head = nn.Linear(cfg.dim_latent, cfg.latent_dim)
        self._init_own_weights()

    def _init_own_weights(self) -> None:
        # Only the parts this module adds; the trunk keeps the package's own initialisation.
        nn.init.normal_(self.token_emb.weight, std=0.02)
        nn.init.normal_(self.text_pos, std=0.02)
        nn.init.normal_(self.latent_pos, std=0.02)
        nn.init.normal_(self.text_head.weight, std=0.02)
        nn.init.zeros_(self.text_head.bias)
        # Zero latent head: the first velocity prediction is 0, a stable start for flow matching.
        nn.init.zeros_(self.latent_head.weight)
        nn.init.zeros_(self.latent_head.bias)

    def forward(
        self,
        tokens: Tensor,
        latents: Tensor,
        t_text: Tensor,
        t_latent: Tensor,
        *,
        want_text: bool = True,
        want_latent: bool = True,
        text_mask: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """``tokens`` [B, text_len] (may hold mask_id), ``latents`` [B, latent_len, latent_dim]
        (already noised), ``t_*`` [B], ``text_mask`` bool [B, text_len] (True = a real token;
        None = all real). A head that is not wanted is not run (returns None), so the clean
        side's head takes no part in the graph and gets no gradient."""
        text = self.token_emb(tokens) + self.text_pos
        lat = self.latent_in(latents) + self.latent_pos
        # The sinusoidal features are computed in fp32 (precise phases) and enter the MLP in its own
        # dtype: bf16 under FSDP's mixed precision, which casts parameters and inputs but not these.
        times = torch.cat([self.time_text(t_text), self.time_latent(t_latent)], dim=-1)
        cond = self.time_mlp(times.to(next(self.time_mlp.parameters()).dtype))
        masks = None if text_mask is None else (text_mask, None)
        text, lat = self.trunk(modality_tokens=(text, lat), modality_masks=masks, time_cond=cond)
        logits = self.text_head(text) if want_text else None
        velocity = self.latent_head(lat) if want_latent else None
        return logits, velocity


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed Python ``random`` and torch's CPU generator; restore both afterwards."""
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)


def build_model(model_cfg: ModelConfig, *, seed: int) -> MMDiTDiffusion:
    """The model for ``model_cfg`` with weights a pure function of ``seed``.

    Works under ``with torch.device("meta"):`` (no memory allocated; preflight counts parameters
    that way). Build on CPU and move afterwards so the initial weights do not depend on the device.
    """
    with _seeded(seed):
        model = MMDiTDiffusion(model_cfg)
    if model_cfg.flash_attn:
        from .attention import use_sdpa_attention

        use_sdpa_attention(model)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once); works on meta tensors."""
    return sum(p.numel() for p in model.parameters())
