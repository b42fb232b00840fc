"""Each preflight check against real files, sockets and names here, and fakes for what cannot exist
here (GPUs via sample nvidia-smi output, InfiniBand via fake sysfs trees, the job's torch via a
static probe answer)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_nccl import fake_sysfs  # same directory (rootdir-relative test imports)

from hpclaunch import __version__
from hpclaunch.config import RunConfig
from hpclaunch.preflight import HostView, Status, run_node_checks
from hpclaunch.preflight.check_context import CheckContext, CommandResult
from hpclaunch.preflight.data_check import check_data
from hpclaunch.preflight.disk import check_disk
from hpclaunch.preflight.env_check import check_env
from hpclaunch.preflight.gpu import GPU_FIELDS_OLD, check_gpu, parse_gpu_query, parse_remapped_rows
from hpclaunch.preflight.layout import check_config
from hpclaunch.preflight.network import check_network, port_in_use, unreachable
from hpclaunch.preflight.node import check_node
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.sizes import estimate_parameters
from hpclaunch.schedulers.protocol import NodeContext
from hpclaunch.shards import synth_dataset

pytestmark = pytest.mark.fast

CPU_TORCH = {
    "version": "2.13.0+cpu",
    "cuda_build": None,
    "cuda_available": False,
    "device_count": 0,
    "devices": [],
    "gloo_available": True,
    "nccl_available": False,
    "nccl_version": None,
}
GPU_TORCH = {
    **CPU_TORCH,
    "version": "2.13.0+cu128",
    "cuda_build": "12.8",
    "cuda_available": True,
    "device_count": 8,
    "nccl_available": True,
    "nccl_version": "2.27.3",
}


def probe_answer(torch: dict[str, Any] = CPU_TORCH, **parts: Any) -> dict[str, Any]:
    answer = {
        "python": "3.11.7",
        "torch": torch,
        "mmdit": {"version": "0.3.0"},
        "hpclaunch": {"version": __version__},
        "model": {"params": 348048},
    }
    answer.update(parts)
    return answer


def config(tmp_path: Path, **sections: Any) -> RunConfig:
    raw: dict[str, Any] = {"name": "t", "train": {"steps": 20, "global_batch": 8, "warmup_steps": 2}}
    raw["checkpoint"] = {"every_steps": 10}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    return RunConfig.model_validate(raw).resolved(tmp_path)


def context(
    cfg: RunConfig, *, probe: dict[str, Any] | None = None, node: NodeContext | None = None, **kw: Any
):
    return CheckContext(cfg=cfg, node=node, probe=StaticProbe(probe or probe_answer()), **kw)


def fake_run(outputs: dict[str, CommandResult | None]):
    """A ``run`` hook answering by the first argv elements joined (longest key wins)."""
    calls: list[list[str]] = []

    def run(argv: Sequence[str], timeout: float) -> CommandResult | None:
        calls.append(list(argv))
        joined = " ".join(argv)
        for key in sorted(outputs, key=len, reverse=True):
            if joined.startswith(key):
                return outputs[key]
        return None

    run.calls = calls  # type: ignore[attr-defined]
    return run


def ok(stdout: str) -> CommandResult:
    return CommandResult(0, stdout, "")


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    synth_dataset(tmp_path / "data", samples=64, seed=0, model_cfg=RunConfig().model, shard_size=16)
    return tmp_path / "data"


def data_cfg(tmp_path: Path, data: Path, **sections: Any) -> RunConfig:
    return config(
        tmp_path, data={"token_dir": str(data / "tokens"), "latent_dir": str(data / "latents")}, **sections
    )


# ---- env ------------------------------------------------------------------------------------


def test_env_pass_line(tmp_path: Path) -> None:
    out = check_env(context(config(tmp_path)))
    assert out.status is Status.PASS
    assert out.finding == f"python 3.11.7, torch 2.13.0+cpu, gloo, mmdit 0.3.0, hpclaunch {__version__}"


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (
            probe_answer(torch={"error": "ModuleNotFoundError: No module named 'torch'"}),
            "torch is not importable",
        ),
        (
            probe_answer(mmdit={"error": "ModuleNotFoundError: No module named 'mmdit'"}),
            "mmdit is not importable",
        ),
        (probe_answer(hpclaunch={"error": "ModuleNotFoundError: hpclaunch"}), "hpclaunch is not importable"),
        (probe_answer(torch={**CPU_TORCH, "version": "2.1.0"}), "older than 2.4"),
        (probe_answer(torch={**CPU_TORCH, "gloo_available": False}), "no gloo"),
    ],
)
def test_env_failures(tmp_path: Path, answer: dict[str, Any], words: str) -> None:
    out = check_env(context(config(tmp_path), probe=answer))
    assert out.status is Status.FAIL and words in out.finding


def test_env_nccl_run_needs_a_cuda_build(tmp_path: Path) -> None:
    cfg = config(tmp_path, scheduler={"gpus_per_node": 8})
    out = check_env(context(cfg))
    assert out.status is Status.FAIL and "CPU-only build" in out.finding


def test_env_gpu_torch_on_a_gpu_less_login_node_is_fine(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, scheduler={"kind": "slurm", "nodes": 2, "gpus_per_node": 8}, train={"global_batch": 16}
    )
    gpu_less = {**GPU_TORCH, "cuda_available": False, "device_count": 0}
    out = check_env(context(cfg, probe=probe_answer(torch=gpu_less)))
    assert (
        out.status is Status.PASS
        and "no GPU on this login node" in out.finding
        and "NCCL 2.27.3" in out.finding
    )
    # on a node (or for the local scheduler) the same answer is a failure
    local = config(tmp_path, scheduler={"gpus_per_node": 1})
    assert check_env(context(local, probe=probe_answer(torch=gpu_less))).status is Status.FAIL


def test_env_version_mismatch_warns(tmp_path: Path) -> None:
    out = check_env(context(config(tmp_path), probe=probe_answer(hpclaunch={"version": "0.0.1"})))
    assert out.status is Status.WARN and "0.0.1" in out.finding


def test_env_job_python_missing(tmp_path: Path) -> None:
    cfg = config(tmp_path, launch={"python": "/opt/site/env/bin/python"})
    missing = StaticProbe(None, error="not found on this machine", python=None)
    login = CheckContext(cfg=cfg, node=None, probe=missing)
    assert check_env(login).status is Status.WARN  # may exist after the job's setup lines
    node = NodeContext("slurm", "1", 0, 1, "n1", ("n1",))
    out = check_env(CheckContext(cfg=cfg, node=node, probe=missing))
    assert out.status is Status.FAIL and "/opt/site/env/bin/python" in out.finding


# ---- gpu (sample nvidia-smi output in the documented CSV format) ----------------------------

H100_HEALTHY = "\n".join(
    f"{i}, NVIDIA H100 80GB HBM3, GPU-6f3a1c0{i}-8d2e-4b7a-9c11-2e5f7a9b{i}d40, 81559, 1, 9.0, 0, [N/A]"
    for i in range(8)
)
A100_BUSY_AND_ECC = """\
0, NVIDIA A100-SXM4-40GB, GPU-aa000000-0000-0000-0000-000000000000, 40960, 0, 8.0, 0, No
1, NVIDIA A100-SXM4-40GB, GPU-aa000000-0000-0000-0000-000000000001, 40960, 30517, 8.0, 2, No
"""
A100_REMAP = """\
GPU-aa000000-0000-0000-0000-000000000000, No, No
GPU-aa000000-0000-0000-0000-000000000001, Yes, No
"""
V100_OLD_DRIVER = """\
0, Tesla V100-SXM2-32GB, GPU-bb000000-0000-0000-0000-000000000000, 32510, 0, 0, No
1, Tesla V100-SXM2-32GB, GPU-bb000000-0000-0000-0000-000000000001, 32510, 0, [N/A], Yes
"""


def test_parse_fake_nvidia_smi_samples() -> None:
    gpus = parse_gpu_query(H100_HEALTHY)
    assert len(gpus) == 8 and gpus[7].index == 7 and gpus[0].compute_cap == (9, 0)
    assert (
        gpus[0].memory_total_mib == 81559 and gpus[0].retired_pending is None and gpus[0].ecc_uncorrected == 0
    )
    a100 = parse_gpu_query(A100_BUSY_AND_ECC)
    assert a100[1].memory_used_mib == 30517 and a100[1].ecc_uncorrected == 2
    old = parse_gpu_query(V100_OLD_DRIVER, GPU_FIELDS_OLD)
    assert old[0].compute_cap is None and old[1].ecc_uncorrected is None and old[1].retired_pending is True
    remap = parse_remapped_rows(A100_REMAP)
    assert [r.pending for r in remap] == [False, True] and remap[1].uuid.endswith("001")
    with pytest.raises(ValueError):
        parse_gpu_query("0, only, three")


def gpu_ctx(
    tmp_path: Path, smi: dict[str, CommandResult | None], *, gpus: int = 8, visible: int = 8, **kw: Any
):
    cfg = config(tmp_path, scheduler={"gpus_per_node": gpus}, **kw)
    torch = {**GPU_TORCH, "device_count": visible}
    return context(cfg, probe=probe_answer(torch=torch), run=fake_run(smi))


def test_gpu_fake_nvidia_smi_healthy_h100(tmp_path: Path) -> None:
    out = check_gpu(
        gpu_ctx(tmp_path, {"nvidia-smi --query-gpu": ok(H100_HEALTHY), "nvidia-smi --query-remapped": ok("")})
    )
    assert out.status is Status.PASS and out.finding == "8 GPU(s) visible (NVIDIA H100 80GB HBM3), 8 needed"


def test_gpu_fake_nvidia_smi_too_few(tmp_path: Path) -> None:
    out = check_gpu(gpu_ctx(tmp_path, {"nvidia-smi --query-gpu": ok(H100_HEALTHY)}, visible=4))
    assert out.status is Status.FAIL and "4 GPU(s) visible, the run needs gpus_per_node=8" in out.finding


def test_gpu_fake_nvidia_smi_ecc_and_pending_remap_fail(tmp_path: Path) -> None:
    smi = {"nvidia-smi --query-gpu": ok(A100_BUSY_AND_ECC), "nvidia-smi --query-remapped": ok(A100_REMAP)}
    out = check_gpu(gpu_ctx(tmp_path, smi, gpus=2, visible=2))
    assert out.status is Status.FAIL
    assert "GPU 1 (NVIDIA A100-SXM4-40GB): 2 uncorrected ECC error(s)" in out.finding
    assert "remapped rows pending" in out.finding


def test_gpu_fake_nvidia_smi_busy_memory_warns(tmp_path: Path) -> None:
    busy = A100_BUSY_AND_ECC.replace(", 2, No", ", 0, No")
    out = check_gpu(gpu_ctx(tmp_path, {"nvidia-smi --query-gpu": ok(busy)}, gpus=2, visible=2))
    assert out.status is Status.WARN and "30517 of 40960 MiB already in use" in out.finding


def test_gpu_fake_nvidia_smi_old_driver_retries_without_compute_cap(tmp_path: Path) -> None:
    calls: list[str] = []

    def run(argv: Sequence[str], timeout: float) -> CommandResult | None:
        calls.append(argv[1])
        if "compute_cap" in argv[1]:
            return CommandResult(2, "", 'Field "compute_cap" is not a valid field to query.')
        if argv[1].startswith("--query-gpu"):
            return ok(V100_OLD_DRIVER)
        return CommandResult(2, "", "not supported")

    cfg = config(tmp_path, scheduler={"gpus_per_node": 2}, train={"precision": "fp32"})
    out = check_gpu(context(cfg, probe=probe_answer(torch={**GPU_TORCH, "device_count": 2}), run=run))
    assert len([c for c in calls if c.startswith("--query-gpu")]) == 2
    assert out.status is Status.FAIL and "retired pages pending" in out.finding


def test_gpu_fake_nvidia_smi_bf16_on_volta(tmp_path: Path) -> None:
    volta = "0, Tesla V100-SXM2-32GB, GPU-bb, 32510, 0, 7.0, 0, No\n"
    warn = check_gpu(gpu_ctx(tmp_path, {"nvidia-smi --query-gpu": ok(volta)}, gpus=1, visible=1))
    assert warn.status is Status.WARN and "no bf16" in warn.finding
    fail = check_gpu(
        gpu_ctx(
            tmp_path, {"nvidia-smi --query-gpu": ok(volta)}, gpus=1, visible=1, train={"precision": "bf16"}
        )
    )
    assert fail.status is Status.FAIL


def test_gpu_skips(tmp_path: Path) -> None:
    out = check_gpu(context(config(tmp_path)))
    assert out.status is Status.SKIP and out.finding == "CPU run (gpus_per_node 0)"
    login = config(tmp_path, scheduler={"kind": "slurm", "gpus_per_node": 8})
    assert "each allocated node" in check_gpu(context(login)).finding


def test_gpu_none_visible_here(tmp_path: Path) -> None:
    """This machine for real: no nvidia-smi, torch without CUDA."""
    cfg = config(tmp_path, scheduler={"gpus_per_node": 1})
    out = check_gpu(
        context(cfg, probe=probe_answer(torch={**GPU_TORCH, "cuda_available": False}), run=fake_run({}))
    )
    assert out.status is Status.FAIL and "no GPU visible (nvidia-smi not found" in out.finding


# ---- data -----------------------------------------------------------------------------------


def test_data_pass(tmp_path: Path, dataset: Path) -> None:
    out = check_data(context(data_cfg(tmp_path, dataset)))
    assert out.status is Status.PASS
    assert "4 shard pair(s), 64 samples" in out.finding and "2.5 epochs" in out.finding


def test_data_missing_dir(tmp_path: Path) -> None:
    cfg = config(
        tmp_path, data={"token_dir": str(tmp_path / "nope/tokens"), "latent_dir": str(tmp_path / "nope/l")}
    )
    out = check_data(context(cfg))
    assert (
        out.status is Status.FAIL and f"{tmp_path}/nope/tokens: token directory does not exist" in out.finding
    )


def test_data_missing_latent_shard(tmp_path: Path, dataset: Path) -> None:
    (dataset / "latents" / "shard_00002.npy").unlink()
    out = check_data(context(data_cfg(tmp_path, dataset)))
    assert out.status is Status.FAIL
    assert "shard_00002.npz" in out.finding and "latents/shard_00002.npy does not exist" in out.finding


def test_data_id_beyond_vocab(tmp_path: Path, dataset: Path) -> None:
    shard = dataset / "tokens" / "shard_00000.npz"
    ids = np.load(shard)["input_ids"].copy()
    ids[3, 5] = 256  # vocab_size 256: ids 0..255
    np.savez(shard, input_ids=ids)
    out = check_data(context(data_cfg(tmp_path, dataset)))
    assert out.status is Status.FAIL and "shard_00000.npz" in out.finding and "256" in out.finding


def test_data_fewer_samples_than_one_batch(tmp_path: Path, dataset: Path) -> None:
    cfg = data_cfg(tmp_path, dataset, train={"global_batch": 128})
    out = check_data(context(cfg))
    assert out.status is Status.FAIL and "fewer than one global batch of 128" in out.finding


def test_data_unreadable_dir(tmp_path: Path, dataset: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    (dataset / "tokens").chmod(0)
    try:
        assert check_data(context(data_cfg(tmp_path, dataset))).status is Status.FAIL
    finally:
        (dataset / "tokens").chmod(0o755)


# ---- disk -----------------------------------------------------------------------------------


def test_disk_pass(tmp_path: Path) -> None:
    out = check_disk(context(config(tmp_path, preflight={"min_free_disk_gb": 0.001})))
    assert out.status is Status.PASS
    assert "3 checkpoints x 5.0 MiB" in out.finding and "348.0k parameters" in out.finding


def test_disk_counts_the_ema_copy_in_every_checkpoint(tmp_path: Path) -> None:
    # 348.0k parameters: 12 bytes each without EMA (weights + two AdamW moments), 16 with its fp32 copy
    plain = check_disk(context(config(tmp_path, preflight={"min_free_disk_gb": 0.001})))
    ema = check_disk(
        context(config(tmp_path, preflight={"min_free_disk_gb": 0.001}, train={"ema_decay": 0.99}))
    )
    assert "3 checkpoints x 5.0 MiB" in plain.finding
    assert "3 checkpoints x 6.4 MiB" in ema.finding, ema.finding


def test_disk_huge_model_fails(tmp_path: Path) -> None:
    huge = {"vocab_size": 1_000_000, "dim_text": 65536, "dim_latent": 8, "dim_cond": 8, "depth": 1}
    cfg = config(tmp_path, model=huge)
    no_probe = CheckContext(cfg=cfg, node=None, probe=StaticProbe(None))  # the formula, not the model
    out = check_disk(no_probe)
    assert out.status is Status.FAIL and "(estimated)" in out.finding
    assert str(tmp_path / "runs" / "t") in out.finding and "free, needs" in out.finding


def test_disk_reserve_threshold(tmp_path: Path) -> None:
    cfg = config(tmp_path, preflight={"min_free_disk_gb": 1e9})  # an exabyte
    out = check_disk(context(cfg))
    assert out.status is Status.FAIL and "preflight.min_free_disk_gb" in out.finding


def test_parameter_formula_matches_the_model() -> None:
    torch = pytest.importorskip("torch")
    from hpclaunch.config import ModelConfig
    from hpclaunch.trainer.model.mmdit_diffusion import build_model, count_parameters

    for kw in ({}, {"depth": 3, "dim_text": 96, "dim_latent": 32, "dim_cond": 48, "heads": 3, "dim_head": 8}):
        m = ModelConfig(**kw)
        with torch.device("meta"):
            exact = count_parameters(build_model(m, seed=0))
        assert estimate_parameters(m) == exact


# ---- network --------------------------------------------------------------------------------


def two_nodes(tmp_path: Path, **extra: Any) -> RunConfig:
    return config(tmp_path, scheduler={"kind": "slurm", "nodes": 2}, train={"global_batch": 8}, **extra)


def test_network_single_node_pass(tmp_path: Path) -> None:
    out = check_network(context(config(tmp_path)))
    assert (
        out.status is Status.PASS
        and "resolves to" in out.finding
        and "the rank host picks its own rendezvous port" in out.finding
    )


def test_network_multinode_head_resolves_to_loopback(tmp_path: Path) -> None:
    node = NodeContext("pbs", "7.server", 1, 2, "other", ("localhost", "other"))
    out = check_network(context(two_nodes(tmp_path), node=node))
    assert out.status is Status.FAIL
    assert "the head node localhost resolves to the loopback address 127.0.0.1" in out.finding


def test_network_rendezvous_port_already_bound(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        cfg = two_nodes(tmp_path, launch={"rdzv_port": port})
        # the head given by address: not loopback, no DNS needed
        node = NodeContext("pbs", "7.server", 0, 2, "203.0.113.10", ("203.0.113.10", "203.0.113.11"))
        out = check_network(context(cfg, node=node))
        assert out.status is Status.FAIL
        assert f"rendezvous port {port} cannot be bound on the head node" in out.finding
        assert "in use" in out.finding
        assert port_in_use(port)
    finally:
        holder.close()
    assert port_in_use(port) is None


def test_network_checks_the_rendezvous_port_the_ranks_of_this_attempt_use(tmp_path: Path) -> None:
    """Issue 49: the node check tested the port keyed on the job id, the ranks use the one keyed on
    the attempt (``jobs.attempt_env``): it checked a port nobody used. One rule now."""
    from hpclaunch.jobs.allocation import Roster
    from hpclaunch.jobs.attempt_env import rank_request
    from hpclaunch.jobs.node_run import NodeRun
    from hpclaunch.orchestrator.plan_build import build
    from hpclaunch.rundir import RunPaths
    from hpclaunch.rundir.plan import rdzv_port_for

    node = NodeContext("pbs", "7.server", 0, 2, "203.0.113.10", ("203.0.113.10", "203.0.113.11"), in_place=2)
    cfg = two_nodes(tmp_path)

    class Nodes:
        def node_address(self, host: str) -> str:
            return host

    run = NodeRun.start(RunPaths(tmp_path / "run"), build(cfg, python="python3"), node, Nodes())  # type: ignore[arg-type]
    request = rank_request(run, Roster(node.hosts))
    port = int(request["rdzv_endpoint"].rsplit(":", 1)[1])
    assert port == rdzv_port_for(node.attempt, None) != rdzv_port_for(node.job_id, None)
    holder = socket.socket()
    try:
        holder.bind(("0.0.0.0", port))
    except OSError:
        pytest.skip(f"port {port} is taken on this machine")
    holder.listen()
    try:
        out = check_network(context(cfg, node=node))
        assert out.status is Status.FAIL and f"rendezvous port {port} cannot be bound" in out.finding
    finally:
        holder.close()


def test_network_reachability_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert unreachable("127.0.0.1", port) is None  # refused: the host answered

    # a silent drop (firewall) cannot be produced here: this sandbox answers every SYN
    def silent(*args: Any, **kw: Any) -> socket.socket:
        raise TimeoutError

    monkeypatch.setattr(socket, "create_connection", silent)
    assert unreachable("203.0.113.1", 9, timeout=0.3) == "no answer within 0.3 s"


def test_network_login_multinode_warns_about_loopback_hostname(tmp_path: Path) -> None:
    ctx = context(two_nodes(tmp_path), hostname="localhost")
    out = check_network(ctx)
    assert out.status is Status.WARN and "loopback" in out.finding


def nccl_cfg(tmp_path: Path, preset: str, env: dict[str, str] | None = None) -> RunConfig:
    return config(tmp_path, scheduler={"gpus_per_node": 1}, nccl={"preset": preset, "env": env or {}})


def test_network_fake_sysfs_socket_ifname_missing(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "sys", net={"lo": "unknown", "eth0": "up"})
    out = check_network(
        context(nccl_cfg(tmp_path, "ethernet", {"NCCL_SOCKET_IFNAME": "ens"}), sysfs_root=root)
    )
    assert out.status is Status.FAIL and "NCCL_SOCKET_IFNAME=ens matches no interface" in out.finding
    assert "(it has eth0, lo)" in out.finding
    down = fake_sysfs(tmp_path / "sys2", net={"eth0": "down"})
    out = check_network(
        context(nccl_cfg(tmp_path, "ethernet", {"NCCL_SOCKET_IFNAME": "=eth0"}), sysfs_root=down)
    )
    assert out.status is Status.FAIL and "none is up" in out.finding


def test_network_fake_sysfs_exclusion_list_and_auto(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "sys", net={"lo": "unknown", "docker0": "up", "ens5": "up"})
    assert check_network(context(nccl_cfg(tmp_path, "ethernet"), sysfs_root=root)).status is Status.PASS
    out = check_network(context(nccl_cfg(tmp_path, "auto"), sysfs_root=root))
    assert out.status is Status.PASS and "NCCL preset ethernet" in out.finding and "ens5" in out.finding


def test_network_fake_sysfs_ib_ports_not_active(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path / "sys", net={"ib0": "up"}, rdma={"mlx5_0": [("DOWN", "InfiniBand")]})
    out = check_network(context(nccl_cfg(tmp_path, "ib"), sysfs_root=root))
    assert (
        out.status is Status.FAIL
        and "expects InfiniBand ports but none is ACTIVE (mlx5_0:1 DOWN)" in out.finding
    )
    active = fake_sysfs(tmp_path / "sys2", net={"ib0": "up"}, rdma={"mlx5_0": [("ACTIVE", "InfiniBand")]})
    assert check_network(context(nccl_cfg(tmp_path, "ib"), sysfs_root=active)).status is Status.PASS
    nothing = fake_sysfs(tmp_path / "sys3", net={"eth0": "up"})
    out = check_network(context(nccl_cfg(tmp_path, "ib"), sysfs_root=nothing))
    assert out.status is Status.FAIL and "no RDMA device" in out.finding


# ---- config ---------------------------------------------------------------------------------


def test_config_layout_line(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        scheduler={"kind": "slurm", "nodes": 2, "procs_per_node": 4, "gpus_per_node": 4},
        train={"global_batch": 64, "micro_batch": 4},
    )
    out = check_config(context(cfg))
    assert out.status is Status.PASS
    assert out.finding.startswith(
        "2 node(s) x 4 rank(s) = 8 (nccl), 8 samples/rank (4 x 2 accumulation steps), "
        "12 CPUs per node (OMP_NUM_THREADS 1)"
    )
    assert "assumed 200 MB/s" in out.finding


def test_config_warnings(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        scheduler={"time_limit": "90s", "mem_gb": 2000},  # the 10B parameters' staging copy fits
        launch={"stop_lead_s": 5},
        checkpoint={"every_steps": 50},
        train={"steps": 20},
    )
    out = check_config(
        CheckContext(cfg=cfg, node=None, probe=StaticProbe(probe_answer(model={"params": 10**10})))
    )
    assert out.status is Status.WARN
    assert "stop_lead_s 5 may be too short" in out.finding
    assert "leaves ~25 s of training per attempt" in out.finding
    assert "every_steps 50 > train.steps 20" in out.finding


def test_a_scripts_run_is_warned_of_a_time_limit_that_leaves_no_training_too(tmp_path: Path) -> None:
    """A script under a 12 s limit trained one step per attempt until its 20 requeues ran out, with
    no word from preflight (the built-in trainer's runs had the warning)."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    raw = {"name": "t", "scheduler": {"time_limit": "12s"}, "script": {"path": str(tmp_path / "train.py")}}
    cfg = RunConfig.model_validate(raw).resolved(tmp_path)
    out = check_config(context(cfg))
    assert out.status is Status.WARN and "scheduler.time_limit 12s leaves ~0 s of training" in out.finding, (
        out
    )


def test_config_step_sleep_gives_a_lower_bound(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        scheduler={"time_limit": "5m"},
        train={"steps": 100},
        testing={"step_sleep_s": 10.0},
        checkpoint={"every_steps": 50},
    )
    out = check_config(context(cfg))
    assert out.status is Status.WARN and "one checkpoint interval takes at least 500 s" in out.finding


def test_config_reports_doubtful_nccl_variables(tmp_path: Path) -> None:
    cfg = config(tmp_path, nccl={"env": {"NCCL_ASYNC_ERROR_HANDLING": "1"}})
    out = check_config(context(cfg))
    assert out.status is Status.WARN
    assert "nccl.env.NCCL_ASYNC_ERROR_HANDLING: is a deprecated alias" in out.finding
    assert out.hint == "use TORCH_NCCL_ASYNC_ERROR_HANDLING"


# ---- node marker ----------------------------------------------------------------------------


def test_node_marker(tmp_path: Path) -> None:
    node = NodeContext("slurm", "9", 0, 1, "n2", ("n2",))
    env = {"HPCLAUNCH_NODE_MARKER_DIR": str(tmp_path)}
    ctx = context(config(tmp_path), node=node, environ=env, hostname="vm")
    assert check_node(ctx).status is Status.PASS
    (tmp_path / "unhealthy-n2").write_text("GPU 3 fell off the bus\n")
    out = check_node(ctx)
    assert (
        out.status is Status.FAIL
        and out.finding == f"marked unhealthy by {tmp_path}/unhealthy-n2: GPU 3 fell off the bus"
    )
    # the login node only looks at its own name and otherwise skips
    assert check_node(context(config(tmp_path), environ=env, hostname="vm")).status is Status.SKIP


def test_run_node_checks_names_the_failing_check(tmp_path: Path, dataset: Path) -> None:
    host = socket.gethostname()
    (tmp_path / f"unhealthy-{host}").touch()
    node = NodeContext("local", "9", 0, 1, host, (host,))
    report = run_node_checks(
        data_cfg(tmp_path, dataset, preflight={"min_free_disk_gb": 0.001}),
        node,
        host=HostView(environ={"HPCLAUNCH_NODE_MARKER_DIR": str(tmp_path)}),
        probe=StaticProbe(probe_answer()),
    )
    assert report.where == f"node {host}"
    assert [c.name for c in report.checks] == [
        "node",
        "env",
        "gpu",
        "data",
        "disk",
        "network",
        "fds",
        "container",
    ]
    assert [c.name for c in report.failed] == ["node"]
    assert report.get("node").finding.endswith("no reason given")


def test_the_node_agents_checks_never_start_the_torch_probe(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every restart runs them: a job-Python import of torch there cost 3-15 s per attempt."""
    from hpclaunch.jobs.node_checks import run_checks as agent_node_checks
    from hpclaunch.orchestrator.plan_build import build
    from hpclaunch.preflight import probe

    def no_probe(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the node checks started the torch probe")

    monkeypatch.setattr(probe.Probe, "__init__", no_probe)
    host = socket.gethostname()
    node = NodeContext("local", "9", 0, 1, host, (host,))
    cfg = data_cfg(tmp_path, dataset, preflight={"min_free_disk_gb": 0.001})
    verdict, rows = agent_node_checks(build(cfg, python="python3"), cfg, node)
    assert verdict.ok, rows
    disk = next(r for r in rows if r["name"] == "disk")
    assert "(estimated)" in disk["finding"]  # sized by formula, not by the probe's model
