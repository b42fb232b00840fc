"""Where ``train.compile``'s caches go (``trainer.setup.compile_cache``): a directory the user chose is
kept, inductor's own default (which it writes into the environment when it first looks) is replaced
by this user's node-local one, 0700; a run's artifacts that cannot be loaded only cost a compile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpclaunch.rundir import RunPaths
from hpclaunch.trainer.setup.compile_cache import CACHE_VAR, CompileCache, artifact_name

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def _own_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "node-tmp"))
    (tmp_path / "node-tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR


def test_inductors_default_is_replaced_by_this_users_node_local_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(CACHE_VAR, default_cache_dir())
    cache = CompileCache(RunPaths(tmp_path / "run"), enabled=True, rank=0, device_kind="cpu")
    cache.prepare()
    expected = tmp_path / "node-tmp" / f"hpclaunch-{os.getuid()}" / "compile"
    assert cache.directory == expected and os.environ[CACHE_VAR] == str(expected)
    assert expected.is_dir() and (expected.parent.stat().st_mode & 0o777) == 0o700


def test_a_directory_the_user_chose_is_kept_and_its_parent_untouched(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o1777)  # like /tmp
    monkeypatch.setenv(CACHE_VAR, str(shared / "mine"))
    cache = CompileCache(RunPaths(tmp_path / "run"), enabled=True, rank=0, device_kind="cpu")
    cache.prepare()
    assert cache.directory == shared / "mine" and os.environ[CACHE_VAR] == str(shared / "mine")
    assert shared.stat().st_mode & 0o7777 == 0o1777


def test_a_node_local_root_that_is_not_private_is_not_used_and_the_rank_compiles_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Issue 49, M4: such a root (any local user can make hpclaunch-<uid> first in a sticky /tmp)
    crashed every attempt in a rank; a compile without the node's cache is only slower."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(CACHE_VAR, default_cache_dir())
    monkeypatch.delenv("HPCLAUNCH_NODE_DIR", raising=False)
    root = tmp_path / "node-tmp" / f"hpclaunch-{os.getuid()}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)  # readable by everyone: another user could plant compiled code
    cache = CompileCache(RunPaths(tmp_path / "run"), enabled=True, rank=0, device_kind="cpu")
    cache.prepare()
    assert cache.directory is not None and not cache.directory.is_relative_to(root)
    assert os.environ[CACHE_VAR] == str(cache.directory)
    assert cache.directory.stat().st_mode & 0o777 == 0o700
    assert list(root.iterdir()) == []  # nothing written into the open one


def test_the_cache_goes_in_the_node_directory_its_agent_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In an image, the node directory the agent mounted (``rundir.node_dir``), not the image's /tmp."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = tmp_path / "mounted" / "hpclaunch-x"
    named.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv(CACHE_VAR, default_cache_dir())
    monkeypatch.setenv("HPCLAUNCH_NODE_DIR", str(named))
    cache = CompileCache(RunPaths(tmp_path / "run"), enabled=True, rank=0, device_kind="cpu")
    cache.prepare()
    assert cache.directory == named / "compile" and cache.directory.is_dir()


def test_a_torn_artifact_is_not_loaded_and_does_not_fail_the_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_VAR, str(tmp_path / "mine"))
    paths = RunPaths(tmp_path / "run")
    artifact = paths.root / "compile_cache" / artifact_name("cpu")
    artifact.parent.mkdir(parents=True)
    artifact.write_bytes(b"not a cache artifact")
    cache = CompileCache(paths, enabled=True, rank=0, device_kind="cpu")
    cache.prepare()
    assert cache.loaded is False


def test_off_when_the_run_does_not_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_VAR, raising=False)
    cache = CompileCache(RunPaths(tmp_path / "run"), enabled=False, rank=0, device_kind="cpu")
    cache.prepare()
    cache.after_step(5)
    assert cache.directory is None and CACHE_VAR not in os.environ
    assert not (tmp_path / "run").exists()


def test_artifact_names_carry_torch_and_the_device_and_are_plain_file_names() -> None:
    import torch

    name = artifact_name("NVIDIA H100 80GB HBM3-sm90")
    assert name.startswith(f"torch-{torch.__version__}") and name.endswith(".bin")
    assert "/" not in name and " " not in name
