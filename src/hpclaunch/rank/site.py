"""Where a rank's run lives and what it was told: the run directory, the run's config, the attempt
and its clock; under an hpclaunch job, or standalone.

Under hpclaunch (a job's node agent, or ``hpclaunch train``) the rank host sets the run directory
(``HPCLAUNCH_RUN_DIR``), the attempt (``HPCLAUNCH_ATTEMPT``) and the attempt's clock; the run's
``config.yaml`` says how to checkpoint, snapshot and watch. That is a *managed* rank.

Anywhere else (``python train.py``, plain ``torchrun``) the rank is *standalone*: the run directory
is ``attach(run_dir=...)``, else ``$HPCLAUNCH_RUN_DIR``, else ``runs/<script name>`` under the
working directory, and the config is the defaults with what ``attach``'s options say. The same
script run again resumes from that directory: no lock-in.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RunConfig, validate_config
from ..rundir import RunPaths, read_config
from ..rundir.clock import AttemptClock
from ..rundir.env import ATTEMPT_VAR, RUN_DIR_VAR

__all__ = ["STANDALONE_ATTEMPT", "RankSite"]

STANDALONE_ATTEMPT = "standalone"


@dataclass(frozen=True)
class RankSite:
    paths: RunPaths
    cfg: RunConfig
    attempt: str
    clock: AttemptClock | None  # None: no deadline (standalone, or no time limit)
    managed: bool  # started by hpclaunch (agent, foreground train) rather than by hand

    @classmethod
    def find(cls, run_dir: str | os.PathLike[str] | None = None, **options: Any) -> RankSite:
        """This rank's site: managed when the rank host said so, standalone otherwise."""
        env = os.environ
        root = env.get(RUN_DIR_VAR)
        if root and env.get(ATTEMPT_VAR) and (Path(root) / "config.yaml").is_file():
            plain = RunPaths(Path(root).resolve())
            cfg = read_config(plain)
            return cls(
                paths=RunPaths.of(plain.root, cfg.checkpoint.dir),
                cfg=cfg,
                attempt=env[ATTEMPT_VAR],
                clock=AttemptClock.from_env(env),
                managed=True,
            )
        return cls.standalone(run_dir or root, **options)

    @classmethod
    def standalone(cls, run_dir: str | os.PathLike[str] | None, **options: Any) -> RankSite:
        """A run directory of the script's own, with the defaults and ``options`` (dotted config
        keys, e.g. ``{"checkpoint.every_steps": 100}``) as its config."""
        root = Path(run_dir) if run_dir else Path("runs") / script_name()
        raw: dict[str, Any] = {"name": _safe_name(root.name)}
        for dotted, value in options.items():
            node = raw
            *sections, key = dotted.split(".")
            for section in sections:
                node = node.setdefault(section, {})
            node[key] = value
        cfg = validate_config(raw, where="hpclaunch.attach()")
        return cls(
            paths=RunPaths.of(root.resolve(), cfg.checkpoint.dir),
            cfg=cfg,
            attempt=STANDALONE_ATTEMPT,
            clock=None,
            managed=False,
        )


def script_name() -> str:
    """The running script's name without its suffix (``train`` for ``python train.py``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    stem = Path(path).stem if path else ""
    return _safe_name(stem) if stem and stem not in ("-c", "__main__") else "run"


def _safe_name(text: str) -> str:
    """A run name the config accepts (letters, digits and ._-, at most 64)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in text)[:64].strip(".-")
    return safe or "run"
