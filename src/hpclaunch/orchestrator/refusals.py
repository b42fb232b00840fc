"""What ``hpclaunch submit`` and ``train`` refuse before they write anything (exit 2), in this
order for both (``refuse_before_writing``):

- a resume whose newest checkpoint was written for another model shape: the run would fail in
  every rank after minutes of start-up, so it is refused here, naming the settings that differ;
- a memory tier whose tmpfs (``checkpoint.memory.dir``) does not exist where the ranks run (this
  machine: ``train``, the local scheduler): it is never created, and the tier would only say so
  from every rank at start-up;
- a ``train.init_from`` that cannot start this run;
- data that cannot be read as the model expects: the training shards and, when configured, the
  validation shards (presence, pairing, dtypes, shapes: headers only, seconds for any size); a
  script's run: its script and working directory.

A new run where a run is already is refused too (``refuse_existing_run``): ``train`` asks before
these, of its one directory without ``--resume``; ``submit`` of every directory it would write.

Bad values within one config (a pad id outside the vocabulary, an FSDP shard size the rank count
cannot satisfy) are refused when the config is loaded. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config import RunConfig
from ..errors import DataError, UserInputError
from ..rundir import RunPaths


def refuse_existing_run(root: Path, *, hint: str, by_config: bool = True) -> None:
    """UserInputError when a run is already in ``root``: its plan or ledger (``by_config``: or its
    config.yaml alone). ``hint``: how the command at hand continues it instead."""
    paths = RunPaths(root)
    if paths.is_run() or (by_config and paths.config.exists()):
        raise UserInputError(f"a run already exists in {root}", where="run_dir", hint=hint)


def refuse_bad_data(cfg: RunConfig) -> None:
    """DataError (exit 2, the file named) when the training or validation shards do not fit the model;
    a data directory that is not there is named by its key and the file or flag that set it. A
    script's run reads its own data: its script must exist instead."""
    if cfg.is_script:
        return refuse_missing_script(cfg)
    from ..shards import validate_dataset

    d = cfg.data
    for key, directory in (
        ("data.token_dir", d.token_dir),
        ("data.latent_dir", d.latent_dir),
        ("data.val_token_dir", d.val_token_dir),
        ("data.val_latent_dir", d.val_latent_dir),
    ):
        if directory and not Path(directory).is_dir():
            what = "is not a directory" if Path(directory).exists() else "does not exist"
            raise DataError(
                f"{key}: {cfg.path_said(key, directory)} {what}",
                where=cfg.origin(key),
                hint=f"set {key} to the directory of its shards, or create them with 'hpclaunch data synth'",
            )
    validate_dataset(d.token_dir, d.latent_dir, cfg.model, max_shards=0)
    if d.val_token_dir and d.val_latent_dir:
        validate_dataset(d.val_token_dir, d.val_latent_dir, cfg.model, max_shards=0)


def refuse_missing_script(cfg: RunConfig) -> None:
    """UserInputError when ``script.path`` is not a file here (or its working directory is missing)."""
    s = cfg.script
    path = Path(str(s.path))
    if not path.is_file():
        raise UserInputError(
            f"script.path {cfg.path_said('script.path', str(path))} is not a file",
            where=cfg.origin("script.path"),
            hint="check the path; relative paths are relative to the working directory",
        )
    if s.workdir and not Path(s.workdir).is_dir():
        raise UserInputError(
            f"script.workdir {s.workdir} is not a directory", where=cfg.origin("script.workdir")
        )


def refuse_missing_memory_dir(cfg: RunConfig) -> None:
    """UserInputError when the memory tier is on and its tmpfs is not a directory on this machine."""
    from ..rundir.shm import base_of

    base = base_of(cfg.checkpoint.memory)
    if cfg.checkpoint.memory.every_steps is None or base.is_dir():
        return
    raise UserInputError(
        f"{base} does not exist: the memory tier's snapshots go to an existing tmpfs, which is never created",
        where="checkpoint.memory.dir",
        hint="set checkpoint.memory.dir to the nodes' tmpfs (e.g. /dev/shm), or null for /dev/shm",
    )


def refuse_other_model_shape(cfg: RunConfig, run_dir: Path) -> None:
    """UserInputError when the run's newest published checkpoint holds another model shape (a
    script's model shapes are checked by its run, which knows them)."""
    if cfg.is_script:
        return
    from ..rundir.checkpoint_manifest import InvalidCheckpoint, published_dirs, read_manifest

    checkpoints = RunPaths.of(run_dir, cfg.checkpoint.dir).checkpoints
    for _, path in reversed(published_dirs(checkpoints)):
        try:
            manifest = read_manifest(path)
        except InvalidCheckpoint:
            continue  # the trainer reports and sets aside what it cannot use
        if manifest.get("model_hash") in (None, *cfg.model_hashes_accepted()):
            return
        raise UserInputError(
            f"checkpoint {path.name} was written for another model shape"
            f"{_differences(manifest.get('extra', {}).get('model'), cfg)}; resuming would fail on every rank",
            where=str(checkpoints),
            hint="restore the model settings the run was started with, or start a new run (another name)",
        )


def _differences(saved: object, cfg: RunConfig) -> str:
    """Every shape setting that differs (those the model hash that refused the resume covers)."""
    from ..rundir.init_source import shape_differences

    if not isinstance(saved, dict):
        return ""
    diffs = shape_differences(saved, cfg, there="in the checkpoint", here="now")
    return f" ({'; '.join(diffs)})" if diffs else ""


def refuse_bad_init_from(cfg: RunConfig, run_dir: Path, *, pending_ok: bool = False) -> None:
    """UserInputError when ``train.init_from`` cannot start this run (missing, no valid checkpoint,
    another model shape, no EMA to take). A run that has checkpoints of its own resumes from them
    and never looks at ``init_from`` again. ``pending_ok``: chained after the source (``--after``)."""
    if not cfg.train.init_from:
        return
    from ..rundir.checkpoint_manifest import published_dirs
    from ..rundir.init_source import check_fits

    if published_dirs(RunPaths.of(run_dir, cfg.checkpoint.dir).checkpoints):
        return
    init_from = cfg.train.init_from
    try:
        check_fits(cfg, pending_ok=pending_ok)
    except UserInputError as e:
        # The trainer names the key; here the file or flag that set it comes first, as for any key.
        said = e.message.replace(init_from, cfg.path_said("train.init_from", init_from), 1)
        raise UserInputError(f"{e.where}: {said}", where=cfg.origin("train.init_from"), hint=e.hint) from None


def resume_step(cfg: RunConfig, run_dir: Path) -> int:
    """The first step a resume trains: one past the run's newest published checkpoint (1: none)."""
    from ..rundir.checkpoint_manifest import published_dirs

    found = published_dirs(RunPaths.of(run_dir, cfg.checkpoint.dir).checkpoints)
    return found[-1][0] + 1 if found else 1


def refuse_before_writing(
    cfg: RunConfig,
    run_dir: Path,
    *,
    resume: bool,
    ranks_here: bool,
    data_of: Sequence[RunConfig] | None = (),
    pending_ok: bool = False,
) -> None:
    """Every refusal above, in one order: a resume onto another model shape, the memory tier's tmpfs
    where the ranks run on this machine (``ranks_here``), a ``train.init_from`` that cannot start
    this run (``pending_ok``: chained after it), then the data (of ``data_of``, each sweep point's;
    ``cfg``'s when empty; None: not read, as ``submit --no-preflight`` asks)."""
    if resume:
        refuse_other_model_shape(cfg, run_dir)
    if ranks_here:  # (elsewhere the tmpfs is the nodes', not this machine's)
        refuse_missing_memory_dir(cfg)
    refuse_bad_init_from(cfg, run_dir, pending_ok=pending_ok)
    if data_of is not None:
        for point in data_of or [cfg]:
            refuse_bad_data(point)
