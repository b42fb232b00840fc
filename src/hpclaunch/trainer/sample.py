"""Generating from a trained run: latents from text, text from latents, or both (``hpclaunch sample``).

- latents from text (``t2l``): flow matching's ODE, integrated with ``steps`` Euler steps from
  pure noise at t = 1 to t = 0 (x_{t-h} = x_t - h * v(x_t, t); the model predicts v = noise - x0);
- text from latents (``l2t``): masked diffusion run backwards. Every real position starts as
  [MASK] (t = 1); at each of ``steps`` steps the model predicts every masked position and the most
  confident predictions are kept until ``round(t * length)`` positions remain masked at the next
  t, so the text is complete at t = 0 (greedy: argmax, ties by position);
- ``joint``: both at once on the same time grid, starting from noise and a fully masked text.

The conditioning side of ``t2l``/``l2t`` comes from the run's data: the first ``n`` validation
samples (``data.val_*_dir`` or ``data.val_fraction``), else the first ``n`` training samples, so a
sample can be scored against the truth that goes with it (``score``). The model is the checkpoint's
EMA when it holds one (``train.ema_decay``), else its weights; loading never changes the run
directory (a run may be writing into it). Outputs are in the trainer's data format:
``OUT/tokens/samples.npz`` (``input_ids``) and ``OUT/latents/samples.npy``, plus ``OUT/samples.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import RunConfig
from ..fsutil import atomic_write_json
from ..rank.checkpoint import load_readonly
from ..shards import TOKENS_KEY, validate_dataset
from .data.dataset import ShardedDataset, holdout_split, text_mask
from .model.ema import clean_name
from .model.mmdit_diffusion import MMDiTDiffusion, build_model

MODES = ("t2l", "l2t", "joint")


@dataclass
class Loaded:
    model: MMDiTDiffusion
    step: int
    ema: bool  # the weights are the checkpoint's EMA


def load_model(cfg: RunConfig, checkpoints: Path, *, step: int | None = None, device: str = "cpu") -> Loaded:
    """The run's model with the weights of checkpoint ``step`` (None: the newest valid one)."""
    model = build_model(cfg.model, seed=cfg.train.seed)
    shadow = {clean_name(n): torch.zeros_like(p) for n, p in model.named_parameters()}
    state: dict[str, Any] = {"model": model.state_dict(), "ema": {"weights": shadow}}
    info, sections = load_readonly(checkpoints, state, step=step)
    use_ema = "ema" in sections
    if use_ema:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(shadow[clean_name(name)])
    return Loaded(model.to(device).eval(), info.step, use_ema)


def conditioning(cfg: RunConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids [n, L] int64, latents [n, Ll, D] float32): the first ``n`` validation samples, else
    training samples (fewer when the data has fewer)."""
    d, m = cfg.data, cfg.model
    if d.val_token_dir and d.val_latent_dir:
        ds = ShardedDataset(validate_dataset(d.val_token_dir, d.val_latent_dir, m, max_shards=0), m)
        indices = np.arange(min(n, ds.num_samples), dtype=np.int64)
    else:
        ds = ShardedDataset(validate_dataset(d.token_dir, d.latent_dir, m, max_shards=0), m)
        if d.val_fraction > 0:
            indices = holdout_split(ds.num_samples, d.val_fraction, cfg.train.seed)[1][:n]
        else:
            indices = np.arange(min(n, ds.num_samples), dtype=np.int64)
    return ds.get(indices)


@torch.no_grad()
def generate(
    model: MMDiTDiffusion,
    mode: str,
    *,
    tokens: torch.Tensor,
    latents: torch.Tensor,
    mask: torch.Tensor | None,
    steps: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, latents) after generating the side(s) ``mode`` names; the other side is kept.

    ``tokens``/``latents`` give the conditioning (and the shapes); ``mask`` marks real tokens
    (padding stays padding; None = all real).
    """
    dev = latents.device
    b = tokens.shape[0]
    gen = torch.Generator().manual_seed(seed)
    text_side, latent_side = mode in ("l2t", "joint"), mode in ("t2l", "joint")
    real = mask if mask is not None else torch.ones_like(tokens, dtype=torch.bool)
    x = torch.randn(latents.shape, generator=gen).to(dev) if latent_side else latents
    ids = torch.where(real, torch.full_like(tokens, model.mask_id), tokens) if text_side else tokens
    lengths = real.sum(dim=1)
    grid = torch.linspace(1.0, 0.0, steps + 1)
    for k in range(steps):
        t, t_next = float(grid[k]), float(grid[k + 1])
        t_text = torch.full((b,), t if text_side else 0.0, device=dev)
        t_lat = torch.full((b,), t if latent_side else 0.0, device=dev)
        logits, velocity = model(
            ids, x, t_text, t_lat, want_text=text_side, want_latent=latent_side, text_mask=mask
        )
        if latent_side:
            assert velocity is not None
            x = x - (t - t_next) * velocity.float()
        if text_side:
            assert logits is not None
            ids = _unmask(ids, logits.float(), real, lengths, t_next, model.mask_id)
    return ids, x


def _unmask(
    ids: torch.Tensor,
    logits: torch.Tensor,
    real: torch.Tensor,
    lengths: torch.Tensor,
    t_next: float,
    mask_id: int,
) -> torch.Tensor:
    """Fill the most confident masked positions so that ``round(t_next * length)`` stay masked."""
    probs, guess = logits.softmax(dim=-1).max(dim=-1)
    masked = ids == mask_id
    keep_masked = torch.round(t_next * lengths.float()).long()
    reveal = masked.sum(dim=1) - keep_masked  # [B] positions to fill now
    # Confidence of masked positions; others sort last. Stable sort: ties go to the earlier position.
    score = torch.where(masked & real, probs, torch.full_like(probs, -1.0))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(ids.shape[1], device=ids.device).expand_as(order))
    chosen = (rank < reveal[:, None]) & masked & real
    return torch.where(chosen, guess, ids)


def score(
    mode: str,
    tokens: np.ndarray,
    latents: np.ndarray,
    truth: tuple[np.ndarray, np.ndarray],
    mask: np.ndarray | None,
) -> dict[str, float]:
    """How close the generated side is to the data that goes with the conditioning side:
    token accuracy over real positions (l2t), mean squared latent error (t2l)."""
    out: dict[str, float] = {}
    true_ids, true_lat = truth
    if mode == "l2t":
        real = mask if mask is not None else np.ones_like(true_ids, dtype=bool)
        out["token_accuracy"] = float((tokens == true_ids)[real].mean())
    if mode == "t2l":
        out["latent_mse"] = float(((latents - true_lat) ** 2).mean())
    return out


def write_samples(out: Path, tokens: np.ndarray, latents: np.ndarray, meta: dict[str, Any]) -> None:
    """``OUT/tokens/samples.npz`` + ``OUT/latents/samples.npy`` (a dataset the trainer could read)."""
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    (out / "latents").mkdir(parents=True, exist_ok=True)
    tmp = out / "tokens" / ".samples.npz.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **{TOKENS_KEY: tokens.astype(np.int32)})  # type: ignore[arg-type]
    tmp.replace(out / "tokens" / "samples.npz")
    tmp = out / "latents" / ".samples.npy.tmp"
    with open(tmp, "wb") as f:
        np.save(f, latents.astype(np.float32))
    tmp.replace(out / "latents" / "samples.npy")
    atomic_write_json(out / "samples.json", json.loads(json.dumps(meta)))


@dataclass(frozen=True)
class SampleRequest:
    """What to generate: ``n`` samples in ``mode`` (t2l, l2t, joint), ``steps`` sampling steps, from
    ``seed``."""

    mode: str
    n: int
    steps: int
    seed: int


def run_sampling(
    cfg: RunConfig,
    checkpoints: Path,
    request: SampleRequest,
    *,
    step: int | None = None,
    device: str = "cpu",
    model: MMDiTDiffusion | None = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Generate the samples ``request`` asks for; returns (token ids, latents, meta with the score
    against the data). ``model`` given: use it instead of a checkpoint (an untrained baseline)."""
    mode, n, steps, seed = request.mode, request.n, request.steps, request.seed
    loaded = (
        Loaded(model.eval(), 0, False)
        if model is not None
        else load_model(cfg, checkpoints, step=step, device=device)
    )
    ids_np, lat_np = conditioning(cfg, n)
    mask_np = text_mask(ids_np, cfg.data.pad_id)
    dev = torch.device(device)
    ids, lat = generate(
        loaded.model, mode, tokens=torch.from_numpy(ids_np).to(dev), latents=torch.from_numpy(lat_np).to(dev),
        mask=None if mask_np is None else torch.from_numpy(mask_np).to(dev), steps=steps, seed=seed,
    )  # fmt: skip
    tokens, latents = ids.cpu().numpy(), lat.cpu().numpy()
    meta = {
        "mode": mode,
        "n": len(tokens),
        "steps": steps,
        "seed": seed,
        "checkpoint_step": loaded.step,
        "ema": loaded.ema,
        "score": score(mode, tokens, latents, (ids_np, lat_np), mask_np),
    }
    return tokens, latents, meta
