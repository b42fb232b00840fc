"""Where ``train.init_from`` points, and whether its weights fit this run's model (torch-free).

``init_from`` names a run directory (its newest valid checkpoint) or one checkpoint directory
(``.../step_000123``). Both the CLI (before anything is written or submitted) and rank 0 of the
trainer (when the weights are loaded) resolve it here, so they agree on what "the newest valid
checkpoint" is. Nothing in the source is ever changed: a checkpoint that fails verification is
skipped, never moved aside (another run owns that directory).

The fit is decided on the settings that fix parameter shapes (every ``model.*`` key but
``flash_attn``, which changes kernels, not shapes); the trainer checks the tensors' shapes against
the checkpoint's DCP metadata again before it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import yaml

from ..config import NOT_SHAPE, RunConfig
from ..errors import UserInputError
from ..fsutil import JSONObject
from .checkpoint_manifest import (
    MANIFEST_NAME,
    InvalidCheckpoint,
    Manifest,
    newest_valid,
    verify_checkpoint,
)
from .paths import RunPaths
from .plan_reader import read_plan_view

HINT = "point train.init_from at a run directory or one of its checkpoints/step_N directories"


class InitSourceJSON(TypedDict):
    """``InitSource.to_json()``: what rank 0 tells the other ranks it loads (with the manifest)."""

    path: str
    step: int
    run: str | None


@dataclass(frozen=True)
class InitSource:
    """The checkpoint a run starts from."""

    path: Path  # the checkpoint directory (step_N)
    step: int
    run: Path | None  # the run it belongs to, when init_from named a run
    manifest: Manifest

    @property
    def has_ema(self) -> bool:
        return bool((self.manifest.get("extra") or {}).get("ema"))

    @property
    def model(self) -> JSONObject | None:
        """The model section of the config the checkpoint was saved with (another version's,
        maybe: its keys are compared by name)."""
        saved = (self.manifest.get("extra") or {}).get("model")
        return saved if isinstance(saved, dict) else None

    def to_json(self) -> InitSourceJSON:
        return {"path": str(self.path), "step": self.step, "run": str(self.run) if self.run else None}


def is_checkpoint_dir(path: Path) -> bool:
    return (path / MANIFEST_NAME).exists() or path.name.startswith("step_")


def checkpoints_of_run(run: Path) -> Path:
    """The run's checkpoint directory (``checkpoint.dir`` as its plan recorded it)."""
    plan = read_plan_view(RunPaths(run))
    return RunPaths.of(run, plan.checkpoint_dir if plan is not None else None).checkpoints


def resolve(init_from: str | Path) -> InitSource:
    """The checkpoint ``init_from`` names, verified against its manifest (UserInputError otherwise)."""
    path = Path(init_from)
    where = "train.init_from"
    if not path.exists():
        raise UserInputError(f"{path} does not exist", where=where, hint=HINT)
    if is_checkpoint_dir(path):
        try:
            info = verify_checkpoint(path)
        except InvalidCheckpoint as e:
            raise UserInputError(f"{path} is not a valid checkpoint: {e}", where=where, hint=HINT) from None
        return InitSource(info.path, info.step, None, info.manifest)
    if not RunPaths(path).is_run():
        raise UserInputError(f"{path} is neither a run directory nor a checkpoint", where=where, hint=HINT)
    newest, skipped = newest_valid(checkpoints_of_run(path))
    if newest is None:
        why = f" ({len(skipped)} invalid: {skipped[0][1]})" if skipped else ""
        raise UserInputError(
            f"run {path} has no valid checkpoint yet{why}",
            where=where,
            hint=f"wait for it, or chain this run after it: hpclaunch submit ... --after {path}",
        )
    return InitSource(newest.path, newest.step, path, newest.manifest)


def run_model(run: Path) -> JSONObject | None:
    """The model section of a run's own config.yaml (before it has any checkpoint)."""
    try:
        data = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, dict) else None


def run_has_ema(run: Path) -> bool | None:
    try:
        data = yaml.safe_load((run / "config.yaml").read_text()) or {}
        return bool((data.get("train") or {}).get("ema_decay"))
    except (OSError, yaml.YAMLError, AttributeError):
        return None


def shape_differences(
    saved: JSONObject, cfg: RunConfig, *, there: str = "there", here: str = "here"
) -> list[str]:
    """``model.<key>: <saved> there, <now> here`` for every shape setting that differs (not
    ``NOT_SHAPE``'s: either loads the other's weights)."""
    now = cfg.model.model_dump(mode="json")
    return [
        f"model.{k}: {saved[k]!r} {there}, {now[k]!r} {here}"
        for k in now
        if k not in NOT_SHAPE and k in saved and saved[k] != now[k]
    ]


def check_fits(cfg: RunConfig, *, pending_ok: bool = False) -> InitSource | None:
    """Refuse (UserInputError, exit 2) an ``init_from`` that cannot start this run.

    ``pending_ok``: the source is a run this one is chained after (``submit --after``): it may have
    no checkpoint yet, and its config.yaml then says which model it trains. Returns the checkpoint
    that would be loaded now (None when there is none yet).
    """
    init_from = cfg.train.init_from
    if not init_from:
        return None
    path = Path(init_from)
    source: InitSource | None = None
    try:
        source = resolve(path)
    except UserInputError:
        if not (pending_ok and RunPaths(path).is_run()):
            raise
    saved = source.model if source is not None else run_model(path)
    where = f"train.init_from ({source.path if source is not None else path})"
    diffs = shape_differences(saved, cfg) if saved else []
    if diffs:
        raise UserInputError(
            f"holds another model shape ({'; '.join(diffs)}); this run's weights cannot start from it",
            where=where,
            hint="use the same model.* shape settings as the run you start from",
        )
    has_ema = source.has_ema if source is not None else run_has_ema(path)
    if cfg.train.init_from_ema and has_ema is False:
        raise UserInputError(
            "has no EMA weights (it was trained without train.ema_decay)",
            where=where,
            hint="set train.init_from_ema: false to start from its weights",
        )
    return source
