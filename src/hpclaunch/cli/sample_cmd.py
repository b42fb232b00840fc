"""``hpclaunch sample RUN``: generate from a run's checkpoint (text from latents, latents from text, both)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import UserInputError
from .common import console

MODES = ("t2l", "l2t", "joint")


def register(app: typer.Typer) -> None:
    app.command("sample")(sample)


def sample(
    run: Annotated[Path, typer.Argument(help="The run directory (runs/<name>).", metavar="RUN")],
    mode: Annotated[
        str, typer.Option("--mode", help="t2l: latents from text; l2t: text from latents; joint: both.")
    ] = "joint",
    n: Annotated[int, typer.Option("--n", help="Number of samples.")] = 16,
    steps: Annotated[int, typer.Option("--steps", help="Euler / unmasking steps from t = 1 to 0.")] = 50,
    step: Annotated[
        int | None, typer.Option("--step", help="Checkpoint step (default: the newest valid one).")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the starting noise.")] = 0,
    out: Annotated[
        Path | None,
        typer.Option("-o", "--out", "--output", help="Output directory (default RUN/samples/step_N-MODE)."),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, or auto.")] = "auto",
) -> None:
    """Generate from a checkpoint (its EMA weights when it has them) in the trainer's data format.

    t2l and l2t take the other side from the run's validation data (else its training data) and
    report how close the result is to the data that goes with it (latent MSE, token accuracy).

    Examples:
      hpclaunch sample runs/tiny --mode l2t --n 32 --steps 20
      hpclaunch sample runs/tiny --mode t2l --step 200 --out samples/t2l
    """
    from ..rundir import RunPaths, read_config
    from .run_dirs import one_run

    paths = one_run(run, "sample")
    if mode not in MODES:
        raise UserInputError(f"--mode {mode!r} is not one of {', '.join(MODES)}", where="sample")
    if n < 1 or steps < 1:
        raise UserInputError("--n and --steps must be at least 1", where="sample")
    cfg = read_config(paths)
    paths = RunPaths.of(paths.root, cfg.checkpoint.dir)

    import torch  # sampling needs it (imported here: the CLI itself stays torch-free)

    from ..trainer.sample import SampleRequest, run_sampling, write_samples

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    request = SampleRequest(mode=mode, n=n, steps=steps, seed=seed)
    tokens, latents, meta = run_sampling(cfg, paths.checkpoints, request, step=step, device=dev)
    target = out or paths.root / "samples" / f"step_{meta['checkpoint_step']:06d}-{mode}"
    meta["run"] = str(paths.root)
    write_samples(target, tokens, latents, meta)
    weights = "EMA weights" if meta["ema"] else "weights"
    scores = ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in meta["score"].items())
    console.print(
        f"wrote {meta['n']} samples ({mode}, {steps} steps, {weights} of step {meta['checkpoint_step']}) "
        f"to {target}" + (f"; against the data: {scores}" if scores else ""),
        highlight=False,
        soft_wrap=True,
    )
