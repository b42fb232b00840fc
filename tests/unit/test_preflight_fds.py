"""The ``fds`` check: ``ulimit -n`` (soft and hard) against the descriptors the job opens at its size."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import fds
from hpclaunch.preflight.check_context import CheckContext
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.results import Status
from hpclaunch.schedulers.protocol import NodeContext

pytestmark = pytest.mark.fast


def cfg_for(tmp_path: Path, nodes: int, procs: int, **checkpoint: Any) -> RunConfig:
    raw = {
        "scheduler": {"kind": "slurm", "nodes": nodes, "gpus_per_node": procs},
        "train": {"global_batch": nodes * procs * 2},
        "checkpoint": checkpoint,
    }
    return RunConfig.model_validate(raw).resolved(tmp_path)


def context(cfg: RunConfig, *, on_node: bool) -> CheckContext:
    node = NodeContext("slurm", "9", 0, cfg.scheduler.nodes, "n0", ("n0",)) if on_node else None
    return CheckContext(cfg=cfg, node=node, probe=StaticProbe({}))


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fake RLIMIT_NOFILE: the check reads it and may raise the soft limit, never this process's."""
    state: dict[str, Any] = {"soft": 1024, "hard": 4096, "raised": None}
    monkeypatch.setattr(fds, "_limits", lambda: (state["soft"], state["hard"]))

    def raise_soft(to: int, hard: int) -> None:
        state["raised"], state["soft"] = to, to

    monkeypatch.setattr(fds, "_raise_soft", raise_soft)
    return state


def test_ulimit_need_grows_with_the_world_size_by_the_formula(tmp_path: Path) -> None:
    # 512 nodes x 8 GPUs: two gloo groups per rank (the host group and the checkpointer's own,
    # W + 3 each), and the rendezvous host's store holds a connection per rank, per writer and per
    # agent (2W + N): that one is larger.
    w = 4096
    big = cfg_for(tmp_path, 512, 8)
    assert fds.gloo_group_sizes(big) == [w, w]
    assert fds.needed_fds(big) == fds.BASE_FDS + 2 * w + 512
    thread = cfg_for(tmp_path, 512, 8, writer="thread")  # no writer processes at the store: a rank
    assert fds.needed_fds(thread) == fds.BASE_FDS + 2 * (w + fds.PER_GLOO_GROUP)
    assert fds.needed_fds(cfg_for(tmp_path, 2, 1)) < 1024


def test_the_deciders_links_count_two_per_agent_spares_included(tmp_path: Path) -> None:
    """jobs.links: the decider's agent holds a connection to every agent and accepts one from each;
    with one rank per node and many hot spares that is the largest count."""
    raw = {
        "scheduler": {"kind": "slurm", "nodes": 512, "spare_nodes": 64, "gpus_per_node": 1},
        "train": {"global_batch": 1024},
        "checkpoint": {"writer": "thread"},
    }
    cfg = RunConfig.model_validate(raw).resolved(tmp_path)
    assert fds.needed_fds(cfg) == fds.BASE_FDS + 2 * (512 + 64)


def test_ulimit_enough_passes_and_says_the_figure(tmp_path: Path, limits: dict[str, Any]) -> None:
    out = fds.check_fds(context(cfg_for(tmp_path, 2, 4), on_node=True))
    assert out.status is Status.PASS and "ulimit -n 1024 (hard 4096)" in out.finding
    assert limits["raised"] is None


def test_ulimit_soft_too_low_is_raised_to_the_hard_limit_on_a_node(
    tmp_path: Path, limits: dict[str, Any]
) -> None:
    cfg = cfg_for(tmp_path, 128, 4)  # W = 512: about 1,400 descriptors on the rendezvous host
    assert 1024 < fds.needed_fds(cfg) <= 4096
    out = fds.check_fds(context(cfg, on_node=True))
    assert out.status is Status.PASS and limits["raised"] == 4096
    assert "raised the soft ulimit -n from 1024 to 4096" in out.finding


def test_ulimit_soft_too_low_on_the_login_node_says_the_nodes_raise_it(
    tmp_path: Path, limits: dict[str, Any]
) -> None:
    out = fds.check_fds(context(cfg_for(tmp_path, 128, 4), on_node=False))
    assert out.status is Status.PASS and "node checks raise the soft limit" in out.finding
    assert limits["raised"] is None


@pytest.mark.parametrize("on_node", [True, False])
def test_ulimit_hard_too_low_fails_with_the_figure_and_what_to_set(
    tmp_path: Path, limits: dict[str, Any], on_node: bool
) -> None:
    cfg = cfg_for(tmp_path, 512, 8)
    need = fds.needed_fds(cfg)
    out = fds.check_fds(context(cfg, on_node=on_node))
    assert out.status is Status.FAIL and limits["raised"] is None
    assert "ulimit -n 1024 (hard 4096)" in out.finding
    assert f"up to {need} descriptors in one process at 4096 ranks" in out.finding
    assert out.hint is not None and f"hard limit of at least {need}" in out.hint


def test_ulimit_unlimited_hard_raises_the_soft_limit_to_what_the_job_needs(
    tmp_path: Path, limits: dict[str, Any]
) -> None:
    limits["hard"] = resource.RLIM_INFINITY
    cfg = cfg_for(tmp_path, 512, 8)
    out = fds.check_fds(context(cfg, on_node=True))
    assert out.status is Status.PASS and limits["raised"] == fds.needed_fds(cfg)
