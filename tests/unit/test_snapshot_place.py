"""The memory tier's place on a shared node (``rundir.shm``, ``snapshots.store``): a private root per
user, checked with ``lstat``; files that never follow a planted link; a base directory that is never
created; held allocations that a sweep leaves alone, and ended ones that it frees. Another user is a
real uid (``nobody``), where the tests run as root."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from tests.shm_fixtures import other_user

from hpclaunch.config import load_config
from hpclaunch.errors import ConfigError
from hpclaunch.rank.snapshots.store import NodeStore, describe_json
from hpclaunch.rundir.shm import Hold, TierPlaceError, private_dirs, sweep, user_root

pytestmark = pytest.mark.fast


def _store(base: Path, allocation: str = "1.0") -> NodeStore:
    return NodeStore(user_root(base) / "run", base, "n1", allocation)


def test_the_users_root_is_made_private_and_everything_below_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.begin(5, 2, 0, 4).publish(describe_json({"nbytes": 4}))
    for d in [user_root(tmp_path), *user_root(tmp_path).rglob("*")]:
        mode = stat.S_IMODE(os.lstat(d).st_mode)
        assert mode & 0o077 == 0, (d, oct(mode))  # no one else reads, lists or enters anything


def test_a_root_open_to_others_a_link_or_another_users_is_refused(tmp_path: Path) -> None:
    root = user_root(tmp_path)
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)  # (as the first user's /dev/shm/hpclaunch was made)
    with pytest.raises(TierPlaceError, match="open to other users") as e:
        _store(tmp_path)
    assert e.value.hint and "chmod 700" in e.value.hint
    root.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    root.symlink_to(elsewhere)  # planted: the snapshots would go where the link points
    with pytest.raises(TierPlaceError, match="not a directory"):
        _store(tmp_path)
    assert list(elsewhere.iterdir()) == []
    root.unlink()
    if os.geteuid() == 0:
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
        with pytest.raises(TierPlaceError, match="belongs to user id 65534"):
            _store(tmp_path)


def test_the_base_directory_is_never_created(tmp_path: Path) -> None:
    """``checkpoint.memory.dir=/nonexistent/shm`` made /nonexistent at the filesystem root."""
    base = tmp_path / "nonexistent" / "shm"
    with pytest.raises(TierPlaceError, match="does not exist"):
        private_dirs(user_root(base) / "run", base)
    assert not (tmp_path / "nonexistent").exists()
    with pytest.raises(ConfigError, match="not an absolute path"):
        load_config(None, ["checkpoint.memory.every_steps=5", "checkpoint.memory.dir=shm"])


def test_a_planted_link_is_never_followed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    step = store.step_dir(5, 2)
    step.mkdir(mode=0o700)
    (step / ".rank-00000.bin.tmp").symlink_to(target)  # where the shard is written
    store.begin(5, 2, 0, 4).publish(describe_json({"nbytes": 4}))
    assert target.read_bytes() == b"keep" and not (step / "rank-00000.bin").is_symlink()
    (step / "rank-00001.json").symlink_to(target)  # a description that is a link
    (step / "rank-00001.bin").symlink_to(target)
    assert 1 not in store.holdings()[5][2]
    with pytest.raises(OSError):
        store.open(5, 2, 1)


def test_a_sweep_frees_what_no_process_holds_and_nothing_held(tmp_path: Path) -> None:
    ended, running = _store(tmp_path, "1.0"), _store(tmp_path, "2.0")
    for s in (ended, running):
        s.begin(5, 2, 0, 4).publish(describe_json({"nbytes": 4}))
    agent = Hold(ended.directory, tmp_path)  # the node agent's hold outlives its ranks' stores
    ended.close(remove=False)
    assert sweep(tmp_path) == []
    agent.release()  # the agent gone too (SIGKILL): nobody holds it
    assert sweep(tmp_path) == [ended.directory]
    assert not ended.directory.exists() and running.holdings()
    running.close(remove=True)
    assert [*user_root(tmp_path).iterdir()] == []


@pytest.mark.spawns
def test_another_user_of_the_node_has_a_tier_of_their_own_and_reads_nothing_of_this_ones() -> None:
    """Root's tier made first (as the first user of a node did), then ``nobody``'s in the same
    tmpfs: it writes and reads its own shard, and cannot list or read root's."""
    uid, gid = other_user()
    base = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="hpclaunch-test-"))  # (the other user reaches it)
    os.chmod(base, 0o1777)  # as /dev/shm itself
    try:
        _two_users(base, uid, gid)
    finally:
        shutil.rmtree(base)


def _two_users(base: Path, uid: int, gid: int) -> None:
    mine = _store(base)
    mine.begin(5, 2, 0, 4).publish(describe_json({"nbytes": 4}))
    theirs = textwrap.dedent(
        f"""
        from pathlib import Path
        from hpclaunch.rundir.shm import user_root
        from hpclaunch.rank.snapshots.store import NodeStore, describe_json
        base = Path({str(base)!r})
        store = NodeStore(user_root(base) / "run", base, "n1", "1.0")
        pending = store.begin(5, 2, 0, 4)
        pending.payload()[:] = b"them"
        pending.publish(describe_json({{"nbytes": 4}}))
        held = store.open(5, 2, 0)
        print("own", bytes(held.payload()).decode())
        for path in (Path({str(user_root(base))!r}), Path({str(mine.step_dir(5, 2) / "rank-00000.bin")!r})):
            try:
                path.read_bytes() if path.suffix else list(path.iterdir())
                print("read", path)
            except PermissionError:
                print("refused")
        """
    )
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", theirs],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:3] == ["own them", "refused", "refused"], proc.stdout
    assert stat.S_IMODE(os.lstat(base / f"hpclaunch-{uid}").st_mode) == 0o700
