"""``hpclaunch data synth``: a small learnable dataset in the trainer's format (never imports torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import load_config
from ..errors import UserInputError
from .common import SetOpt, command_group, console

data_app, register = command_group(
    "data",
    "Datasets in the trainer's format.\n\nExamples:\n"
    "  hpclaunch data synth data/tiny --samples 1024\n"
    "  hpclaunch data synth data/big --samples 100000 --config run.yaml",
)


@data_app.command("synth")
def synth(
    out: Annotated[
        Path, typer.Argument(help="Output directory (gets tokens/ and latents/).", show_default=False)
    ],
    samples: Annotated[int, typer.Option("--samples", help="Number of samples.", show_default=False)],
    seed: Annotated[int, typer.Option("--seed", help="Seed of the dataset's randomness.")] = 0,
    shard_size: Annotated[int, typer.Option("--shard-size", help="Samples per shard file.")] = 1024,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="Take the model shapes (model.*) from this run config.", show_default=False
        ),
    ] = None,
    overrides: SetOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Write into OUT even if it already holds shards.")
    ] = False,
    pad_id: Annotated[
        int | None,
        typer.Option(
            "--pad-id",
            help="Variable-length text: pad each sample's tail with this id (set data.pad_id to it).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write a small learnable dataset: OUT/tokens/*.npz (input_ids) + OUT/latents/*.npy.

    Text repeats a few short motifs; latents are a fixed function of the text, so both the text
    and the latent loss fall in a short run. Shapes follow model.* (vocab_size, text_len,
    latent_len, latent_dim) of --config and --set.

    Example: hpclaunch data synth data/tiny --samples 512 --set model.text_len=64
    """
    from ..shards import synth_dataset

    for item in overrides or []:
        if not item.strip().startswith("model."):
            raise UserInputError(
                f"--set {item}: only model.* keys shape a dataset",
                where="data synth",
                hint="e.g. --set model.text_len=64 --set model.vocab_size=512",
            )
    if samples < 1:
        raise UserInputError(f"--samples {samples}: need at least 1 sample", where="data synth")
    if shard_size < 1:
        raise UserInputError(f"--shard-size {shard_size}: need at least 1", where="data synth")
    model_cfg = load_config(config, overrides or []).model
    if pad_id is not None and not 0 <= pad_id < model_cfg.vocab_size:
        raise UserInputError(
            f"--pad-id {pad_id} is outside the vocabulary (model.vocab_size={model_cfg.vocab_size}: "
            f"ids 0..{model_cfg.vocab_size - 1})",
            where="data synth",
        )
    if out.exists() and not out.is_dir():
        raise UserInputError("exists and is not a directory", where=str(out))
    existing = [*out.glob("tokens/*.npz"), *out.glob("latents/*.npy")] if out.is_dir() else []
    if existing and not force:
        raise UserInputError(
            f"already holds {len(existing)} shard files",
            where=str(out),
            hint="choose another directory, or pass --force to overwrite",
        )
    for path in existing:
        path.unlink()
    try:
        info = synth_dataset(
            out, samples=samples, seed=seed, model_cfg=model_cfg, shard_size=shard_size, pad_id=pad_id
        )
    except OSError as e:
        raise UserInputError(f"cannot write the dataset ({e.strerror})", where=str(out)) from None
    m = model_cfg
    console.print(
        f"wrote {info.num_samples} samples in {len(info.shards)} shards to {out}: "
        f"tokens/ input_ids [N, {m.text_len}] int32 (vocab {m.vocab_size}), "
        f"latents/ [N, {m.latent_len}, {m.latent_dim}] float32"
        + (f"; text padded with id {pad_id} (set data.pad_id: {pad_id})" if pad_id is not None else ""),
        highlight=False,
        soft_wrap=True,
    )
