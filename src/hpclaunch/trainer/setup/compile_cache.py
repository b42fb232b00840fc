"""Compiled code that outlives an attempt: ``train.compile``'s caches, node-local and seeded from the
run directory, so a cache miss costs once per job and node, not once per attempt.

``torch.compile`` keeps what it made (the FX graphs, AOTAutograd's results, inductor's kernels and
their autotuning) in ``TORCHINDUCTOR_CACHE_DIR``. Each rank points it at a node-local directory of
this user (``<node dir>/compile``, 0700, shared by the user's runs: ``rundir.node_dir``; a directory
the user set in ``TORCHINDUCTOR_CACHE_DIR`` is kept), so an in-place restart on the same node finds every
graph compiled before and pays only Dynamo's tracing and the loading of the cached code. A requeued
attempt or a continuation job may land on other nodes with an empty ``/tmp``: there rank 0's
collection of the caches it used (torch's cache artifacts, "Mega-Cache",
``torch.compiler.save_cache_artifacts``), written to ``RUN/compile_cache/<torch>-<device>.bin``
after the first steps, is loaded into the node-local caches before the first compile
(``load_cache_artifacts``). The artifacts hold compiled code and its keys, no pickled objects of
ours; one made by another torch version or device kind is a different file and never read.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

from ...fsutil import atomic_write_bytes
from ...rundir import RunPaths
from ...rundir.node_dir import rank_node_dir
from ...rundir.shm import TierPlaceError, private_dirs

__all__ = ["CompileCache"]

CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
# Rank 0 saves the artifacts once its step has run forward and backward compiled twice (the first
# step compiles; a second can recompile for what the first one changed, e.g. the optimizer's state).
SAVE_AFTER_STEP = 2


def node_cache_dir() -> Path | None:
    """This user's node-local cache directory (in the node directory its agent named, mounted in the
    image when there is one: ``rundir.node_dir``), shared by the user's runs (inductor keys every
    entry by what it compiled, so another run of the same model is warm too); None when no private
    one can be had here."""
    node = rank_node_dir()
    if node is None:
        return None
    try:
        return private_dirs(node / "compile", node.parent, root=node)
    except (TierPlaceError, OSError) as e:
        why = e.one_line() if isinstance(e, TierPlaceError) else str(e)
        print(f"hpclaunch: no node-local compile cache ({why}): compiling without one", file=sys.stderr)
        return None


def _private_dir() -> Path | None:
    try:
        return Path(tempfile.mkdtemp(prefix="hpclaunch-compile-"))
    except OSError:
        return None


def artifact_name(device_kind: str) -> str:
    """``<torch version>-<device kind>.bin``, safe as a file name."""
    import torch

    raw = f"torch-{torch.__version__}-{device_kind}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", raw) + ".bin"


class CompileCache:
    """One rank's compile caches for one attempt; does nothing when ``train.compile`` is off."""

    def __init__(self, paths: RunPaths, *, enabled: bool, rank: int, device_kind: str):
        self.enabled, self.rank = enabled, rank
        self.artifact = paths.root / "compile_cache" / artifact_name(device_kind) if enabled else None
        self.directory: Path | None = None
        self.loaded = False  # whether the run directory's artifacts were loaded
        self.saved = False

    def prepare(self) -> None:
        """Before the first compile: the node-local directory, seeded from the run directory."""
        if not self.enabled:
            return
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # Inductor writes its default into the environment when it first looks (in this process or
        # the rank host's that forked it): only another value is the user's choice.
        chosen = os.environ.get(CACHE_VAR)
        if chosen and chosen != default_cache_dir():
            self.directory = Path(chosen)  # the user's: left as it is
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        else:
            # This user's alone, each folder checked (compiled code is run from here); without one,
            # a private directory of this process's, which only this attempt finds warm: a compile
            # without a cache is slower, never a rank's failure.
            self.directory = node_cache_dir() or _private_dir()
            if self.directory is not None:  # (else inductor's default)
                os.environ[CACHE_VAR] = str(self.directory)
        if self.artifact is not None and self.artifact.is_file():
            import torch

            try:  # (torch logs and answers None for bytes it cannot read)
                self.loaded = torch.compiler.load_cache_artifacts(self.artifact.read_bytes()) is not None
            except Exception:  # a stale or torn file only costs a compile
                self.loaded = False

    def after_step(self, step: int) -> None:
        """Rank 0, once: the caches this process used, into the run directory (atomically)."""
        if not self.enabled or self.saved or self.rank != 0 or step < SAVE_AFTER_STEP:
            return
        self.saved = True
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is None or self.artifact is None:
            return
        blob = saved[0]
        if self.artifact.is_file() and self.artifact.read_bytes() == blob:
            return
        self.artifact.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.artifact, blob)
