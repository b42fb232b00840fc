"""The smallest MMDiT the in-process trainer tests use (overrides for ``load_config``)."""

from __future__ import annotations


def tiny_model(depth: int = 1) -> list[str]:
    return [
        f"model.depth={depth}",
        "model.dim_text=32",
        "model.dim_latent=32",
        "model.dim_cond=32",
        "model.heads=2",
        "model.text_len=16",
        "model.latent_len=4",
        "model.latent_dim=8",
        "model.vocab_size=64",
    ]
