"""Weights & Biases (``train.wandb``, the optional extra ``hpclaunch[wandb]``), written by rank 0.

One W&B run spans every attempt of an hpclaunch run: its id is made once and kept in
``RUN/wandb/hpclaunch-id.json``, and every attempt calls ``wandb.init(id=..., resume="allow")``.
Offline, each attempt writes its own ``RUN/wandb/offline-run-*-<id>/`` under that one id, and
``wandb sync`` joins them into one run. The scalars are TensorBoard's, under the same tags
(``tensorboard.TAGS``); starts and stops are marked as ``run/resumed``, ``run/stopped`` and
``run/finished`` (1 at that step) with the words in ``run/event``.

W&B keeps one row per step and refuses steps that go back. A resumed attempt's first row is the
step after its checkpoint, so its ``run/resumed`` mark goes there; steps an earlier attempt logged
after its last checkpoint (a crash) are computed again but W&B keeps the first values it got
(TensorBoard's ``purge_step`` hides them instead).

The API key is read by wandb from ``WANDB_API_KEY``, which reaches the job only by name
(``launch.pass_env``): hpclaunch never writes it into a script, the config or this directory.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...config import RunConfig
from ...fsutil import atomic_write_json
from .tensorboard import TAGS, step_of

if TYPE_CHECKING:  # a type only: trainer.metrics_window imports torch
    from .metrics_window import Window

ID_FILE = "hpclaunch-id.json"


def stable_id(directory: Path) -> str:
    """The W&B run id of this hpclaunch run: made by its first attempt, read by every later one."""
    path = directory / ID_FILE
    try:
        return str(json.loads(path.read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    run_id = secrets.token_hex(6)  # W&B ids: letters, digits, - and _
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"id": run_id})
    return run_id


class WandbLog:
    """Rank 0's W&B run for one attempt."""

    OFFLINE_ACTION = "logging offline to RUN/wandb/ instead (upload it later with wandb sync)"

    def __init__(self, cfg: RunConfig, run_dir: Path, *, attempt: str, resumed_step: int):
        import wandb

        w = cfg.train.wandb
        assert w is not None
        directory = run_dir / "wandb"
        self.run_id = stable_id(directory)
        config = {k: v for k, v in cfg.to_dict().items() if k != "testing"}
        args: dict[str, Any] = {
            "project": w.project,
            "entity": w.entity,
            "name": w.name or cfg.name,
            "tags": list(w.tags),
            "id": self.run_id,
            "resume": "allow",
            "dir": str(run_dir),
            "config": {**config, "hpclaunch_attempt": attempt},
            # The node agent keeps the ranks' output in the node logs; W&B need not capture it again.
            "settings": wandb.Settings(console="off", silent=True),
        }
        # Online with no way to the server (a compute node without internet, an outage): the
        # attempt goes on offline into RUN/wandb/ under the same id, for `wandb sync` later.
        self.offline_because: str | None = None
        try:
            self._run = wandb.init(mode=w.mode, **args)
        except Exception as e:
            if w.mode != "online":
                raise
            from ...errors import error_text

            self.offline_because = f"W&B unreachable ({error_text(e)})"
            # The failed init keeps the run id taken in wandb's service ("run ID ... is in use"):
            # a fresh service takes it offline.
            with contextlib.suppress(Exception):
                wandb.teardown()
            self._run = wandb.init(mode="offline", **args)

    def scalars(self, record: Window) -> None:
        """The numbers of one metrics.jsonl line, under TensorBoard's tags."""
        values = {
            tag: float(value)
            for field, tag in TAGS.items()
            if isinstance(value := record.get(field), (int, float)) and not isinstance(value, bool)
        }
        if values:
            self._run.log(values, step=int(step_of(record)))

    def mark(self, what: str, step: int, text: str) -> None:
        """A start or stop at ``step`` (a resume is marked at the first step it computes)."""
        at = step + 1 if what == "resumed" else step
        self._run.log({f"run/{what}": 1.0, "run/event": text}, step=at)

    def close(self) -> None:
        self._run.finish()
