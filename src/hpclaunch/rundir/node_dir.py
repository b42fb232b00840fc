"""This user's node-local directory: what the ranks and their node agent share on one node (the
ranks' heartbeats, ``rundir.progress_files``; torch.compile's caches, ``trainer.setup.compile_cache``), and
where the ranks find it when they run in a container image.

    <node tmp>/hpclaunch-<uid>/                        <node tmp>: the agent's $TMPDIR, else /tmp
        progress/<run key>/<node>/<attempt>/rank<r>.progress.json
        compile/

Made 0700 by this user and checked at every use (``shm.private_dirs``). In a sticky /tmp any
local user can make ``hpclaunch-<uid>`` first (a directory of theirs, a link): that node then uses
a private directory of its own instead (``mkdtemp``: 0700 under a random name nobody can have made
first), and says so. A node-local directory is never a reason for the run to fail: where not even
that can be made, the node fails its check (``jobs.node_checks``) and a spare takes its place.

In a container the ranks' /tmp is often not the node's: enroot (pyxis) and podman mount a private
tmpfs there, Apptainer does with ``--contain``, ch-run binds the node's ``$TMPDIR`` (not /tmp) at /tmp
and has ``--private-tmp``. So every runtime's command line mounts the node directory at
``/tmp/<its name>`` in the image (``ContainerPlan.wrap``), and the agent hands the ranks that path
(``NODE_DIR_VAR``); below it, paths are the same inside and outside. (Not the node's own path: a
Charliecloud image is read-only, and ch-run can make a mount point only in its own /tmp.) The rank
host proves it at its start, writing inside what the agent reads outside (``seen_file``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .shm import TierPlaceError, check_private, private_dirs

IN_IMAGE_TMP = Path("/tmp")  # where the node directory is mounted in an image, under its own name


def usual_name() -> str:
    return f"hpclaunch-{os.getuid()}"


def node_tmp() -> Path:
    """This process's node-local temporary directory ($TMPDIR where it is usable, else /tmp)."""
    return Path(tempfile.gettempdir())


@dataclass(frozen=True)
class NodeDir:
    """The node directory on the node (``path``: the agent's view) and as the ranks see it."""

    path: Path
    ranks_path: Path
    fallback: str = ""  # why the usual directory was not used ("" when it was)

    @classmethod
    def prepare(cls, *, tmp: Path | None = None, in_image: bool = False) -> NodeDir:
        """The node directory, made private (or a private fallback: see the module docstring);
        ``in_image``: the ranks run in a container image. Raises ``TierPlaceError`` only when no
        private directory at all can be made in the node's temporary directory."""
        base = tmp or node_tmp()
        usual = base / usual_name()
        try:
            path, why = private_dirs(usual, base, root=usual), ""
        except (TierPlaceError, OSError) as e:
            why = e.one_line() if isinstance(e, TierPlaceError) else str(e)
            path = _private_fallback(base, why)
        ranks = IN_IMAGE_TMP / path.name if in_image else path
        return cls(path, ranks, why)

    def for_ranks(self, path: Path) -> Path:
        """``path`` (below the node directory) as the ranks see it."""
        return self.ranks_path / Path(path).relative_to(self.path)

    def remove_fallback(self) -> None:
        """A fallback directory is this agent's alone: removed when the agent leaves."""
        if self.fallback:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)


def node_directory(*, in_image: bool) -> NodeDir | None:
    """The node agent's ``NodeDir.prepare``, or None (said) when no private directory can be made
    here at all: the ranks then report in the run directory, as without an agent."""
    try:
        return NodeDir.prepare(in_image=in_image)
    except TierPlaceError as e:
        print(
            f"hpclaunch: {e.one_line()}; the ranks report in the run directory", file=sys.stderr, flush=True
        )
        return None


def _private_fallback(base: Path, why: str) -> Path:
    try:
        made = Path(tempfile.mkdtemp(prefix=f"{usual_name()}-", dir=base))
    except OSError as e:
        raise TierPlaceError(
            f"no private node-local directory can be made in {base}: {why}; and {e.strerror or e}",
            hint=f"remove or fix {base / usual_name()} on this node, or set TMPDIR to a writable local disk",
        ) from None
    print(
        f"hpclaunch: {why}; this node uses {made} instead (remove the other one to stop this)",
        file=sys.stderr,
        flush=True,
    )
    return made


def rank_node_dir() -> Path | None:
    """A rank's node directory: the one its agent named (``NODE_DIR_VAR``), checked private; else
    (no agent: a test, a trainer run by hand) the usual one, made private. None when it cannot be
    used: the caller does without (compiling without a cache is slower, not fatal)."""
    from .env import NODE_DIR_VAR

    named = os.environ.get(NODE_DIR_VAR)
    try:
        if named:  # (made by the agent, and mounted: never made here, where it would not be shared)
            check_private(Path(named))
            return Path(named)
        base = node_tmp()
        return private_dirs(base / usual_name(), base, root=base / usual_name())
    except (TierPlaceError, OSError) as e:
        why = e.one_line() if isinstance(e, TierPlaceError) else str(e)
        print(f"hpclaunch: the node-local directory cannot be used ({why})", file=sys.stderr, flush=True)
        return None


SEEN_PREFIX = ".seen-"


def seen_file(node_dir: Path, token: str) -> Path:
    """What the rank host writes in its node directory at its start, and the agent reads outside."""
    return node_dir / f"{SEEN_PREFIX}{token}"


def write_seen() -> str | None:
    """The rank host, at its start: ``seen_file`` in the node directory it was given (``NODE_DIR_VAR``,
    with the token its agent chose); the error in words, or None."""
    from .env import NODE_DIR_TOKEN_VAR, NODE_DIR_VAR

    named, token = os.environ.get(NODE_DIR_VAR), os.environ.get(NODE_DIR_TOKEN_VAR)
    if not named or not token:
        return None
    try:
        seen_file(Path(named), token).write_text(f"{os.getpid()}\n")
    except OSError as e:
        return f"cannot write in {named}: {e.strerror or e}"
    return None


def consume_seen(node_dir: Path, token: str) -> bool:
    """The agent: whether the rank host's ``seen_file`` is there (removed once read)."""
    path = seen_file(node_dir, token)
    found = path.is_file()
    with contextlib.suppress(OSError):
        path.unlink()
    return found
