"""The training data's on-disk format (``format``) and a synthetic learnable set (``synth``).

Torch-free: imported by preflight, the CLI and the trainer."""

from .format import (
    DEFAULT_SHARD_SIZE,
    TOKENS_KEY,
    DatasetInfo,
    ShardInfo,
    open_latent_array,
    open_token_array,
    validate_dataset,
)
from .synth import synth_dataset

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "TOKENS_KEY",
    "DatasetInfo",
    "ShardInfo",
    "open_latent_array",
    "open_token_array",
    "synth_dataset",
    "validate_dataset",
]
