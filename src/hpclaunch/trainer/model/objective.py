"""The training objective: masked diffusion on text, flow matching on latents.

Determinism rule: every random draw for a sample (its two diffusion times, which tokens are
masked, the latent noise) comes from a generator seeded by a hash of (seed, global step, global
sample position), drawn on the CPU in a fixed order. Nothing depends on hidden RNG state, a rank's
identity or the device, so a resumed run, or a run on a different number of ranks with the same
global batch, draws exactly the same numbers for the same sample.

- text (masked diffusion): t_text ~ U(0, 1]; ``max(1, round(t * text_len))`` positions (the ones
  with the smallest uniform keys) are replaced by the mask id; loss = cross entropy on the masked
  positions only, averaged over all masked positions of the micro-batch.
- latents (flow matching): t_latent ~ U[0, 1); x_t = (1 - t) x0 + t noise; the model predicts
  the velocity noise - x0; loss = mean squared error over all latent elements.
- mode ``l2t``: latents clean (t_latent = 0, no noise), no latent loss; ``t2l``: text clean
  (t_text = 0, nothing masked), no text loss. The clean side's head is not run at all.
- variable-length text (``data.pad_id``): ``text_mask`` marks real tokens. Padding is never
  masked and never scored, the number masked is ``max(1, round(t * real_length))``, and the model
  gets the mask as mmdit's modality mask (padding is not attended to). Without a mask the
  arithmetic is exactly that of fixed-length text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from ...config import RunConfig

_MASK64 = (1 << 64) - 1


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 chain): stable across runs, platforms, versions."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h >> 1


@dataclass
class Draws:
    """The random numbers of a micro-batch (CPU tensors)."""

    t_text: Tensor  # [B]
    t_latent: Tensor  # [B]
    mask_keys: Tensor  # [B, text_len] uniforms; the smallest ones are masked
    noise: Tensor  # [B, latent_len, latent_dim]


def draw(seed: int, step: int, positions: list[int], text_len: int, latent_shape: tuple[int, int]) -> Draws:
    """Draws for the samples at global ``positions`` of optimizer step ``step``.

    Per sample, in this order from its own generator: ``2 + text_len`` uniforms (the two times,
    then the mask keys), then the latent noise. A sample's numbers do not depend on which other
    samples share its batch.
    """
    b = len(positions)
    uniforms = torch.empty(b, 2 + text_len)
    noise = torch.empty((b, *latent_shape))
    gen = torch.Generator()
    for j, pos in enumerate(positions):
        gen.manual_seed(mix_seed(seed, step, pos))
        torch.rand(2 + text_len, generator=gen, out=uniforms[j])
        torch.randn(latent_shape, generator=gen, out=noise[j])
    # t_text in (0, 1]: at least one token is always masked
    return Draws(1.0 - uniforms[:, 0], uniforms[:, 1].clone(), uniforms[:, 2:].clone(), noise)


@dataclass(frozen=True)
class Objective:
    """What is trained: which sides are noised (``mode``: joint, t2l or l2t), the token that masks
    text (the vocabulary's size, one past the last real id) and the weights of the two losses."""

    mode: str
    mask_id: int
    text_weight: float
    latent_weight: float

    @classmethod
    def of(cls, cfg: RunConfig) -> Objective:
        t = cfg.train
        return cls(t.mode, cfg.model.vocab_size, t.text_weight, t.latent_weight)


@dataclass
class Losses:
    total: Tensor
    text: Tensor  # 0 when the text side is clean (mode t2l)
    latent: Tensor  # 0 when the latent side is clean (mode l2t)
    # Detached sums and counts behind the two means (validation adds them up over batches and ranks).
    text_sum: Tensor | None = None
    text_count: Tensor | None = None
    latent_sum: Tensor | None = None
    latent_count: float | None = None


def compute_losses(
    model: torch.nn.Module,
    tokens: Tensor,
    latents: Tensor,
    d: Draws,
    objective: Objective,
    *,
    text_mask: Tensor | None = None,
) -> Losses:
    """Noise the batch per ``d`` and ``objective.mode``, run ``model``, return the weighted losses.

    ``tokens``/``latents``, ``text_mask`` (bool [B, text_len], True = a real token; None = no
    padding) and the tensors of ``d`` must already be on the model's device.
    """
    text_noised = objective.mode != "t2l"
    latent_noised = objective.mode != "l2t"
    b, n = tokens.shape

    if text_noised:
        t_text = d.t_text
        if text_mask is None:
            k = torch.clamp(torch.round(t_text * n), min=1).long()  # [B] positions to mask
            keys = d.mask_keys
        else:  # only real tokens are masked: padding sorts last (keys are < 1)
            real = text_mask.sum(dim=1)
            k = torch.minimum(torch.clamp(torch.round(t_text * real), min=1).long(), real)
            keys = torch.where(text_mask, d.mask_keys, torch.full_like(d.mask_keys, 2.0))
        rank = keys.argsort(dim=1).argsort(dim=1)  # rank of each key within its row
        masked = rank < k[:, None]
        text_in = torch.where(masked, torch.full_like(tokens, objective.mask_id), tokens)
    else:
        t_text = torch.zeros_like(d.t_text)
        masked = None
        text_in = tokens

    if latent_noised:
        t_lat = d.t_latent
        tl = t_lat[:, None, None]
        lat_in = (1 - tl) * latents + tl * d.noise
    else:
        t_lat = torch.zeros_like(d.t_latent)
        lat_in = latents

    extra = {} if text_mask is None else {"text_mask": text_mask}
    logits, velocity = model(
        text_in, lat_in, t_text, t_lat, want_text=text_noised, want_latent=latent_noised, **extra
    )

    zero = latents.new_zeros(())
    text_loss = zero
    latent_loss = zero
    out = Losses(zero, zero, zero)
    if text_noised:
        assert logits is not None and masked is not None
        ce = F.cross_entropy(logits.float().reshape(b * n, -1), tokens.reshape(-1), reduction="none")
        m = masked.reshape(-1).float()
        text_sum, text_count = (ce * m).sum(), m.sum()
        text_loss = text_sum / text_count
        out.text_sum, out.text_count = text_sum.detach(), text_count
    if latent_noised:
        assert velocity is not None
        target = d.noise - latents
        latent_loss = F.mse_loss(velocity.float(), target)
        out.latent_sum = latent_loss.detach() * target.numel()
        out.latent_count = float(target.numel())
    out.total = objective.text_weight * text_loss + objective.latent_weight * latent_loss
    out.text, out.latent = text_loss.detach(), latent_loss.detach()
    return out
