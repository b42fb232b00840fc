"""NCCL presets, auto detection on fake sysfs trees, and validation of NCCL/torch variables."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpclaunch import nccl
from hpclaunch.config import NcclConfig
from hpclaunch.errors import UserInputError
from hpclaunch.nccl import (
    PRESETS,
    NetInterface,
    detect_fabric,
    match_socket_ifname,
    nccl_environment,
    resolve_preset,
    static_preset_env,
    validate_nccl_env,
)

pytestmark = pytest.mark.fast

# ---- fake sysfs -----------------------------------------------------------------------------


def fake_sysfs(
    root: Path,
    *,
    net: dict[str, str] | None = None,
    rdma: dict[str, list[tuple[str, str]]] | None = None,
    drivers: dict[str, str] | None = None,
) -> Path:
    """/sys/class/net/<if>/operstate and /sys/class/infiniband/<dev>/ports/<n>/{state,link_layer}."""
    for name, state in (net or {}).items():
        d = root / "class" / "net" / name
        d.mkdir(parents=True)
        (d / "operstate").write_text(state + "\n")
    for dev, ports in (rdma or {}).items():
        for i, (state, link) in enumerate(ports, start=1):
            p = root / "class" / "infiniband" / dev / "ports" / str(i)
            p.mkdir(parents=True)
            code = {"ACTIVE": 4, "DOWN": 1, "INIT": 2}.get(state, 1)
            (p / "state").write_text(f"{code}: {state}\n")
            (p / "link_layer").write_text(link + "\n")
    for dev, driver in (drivers or {}).items():
        target = root / "bus" / "pci" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        devdir = root / "class" / "infiniband" / dev / "device"
        devdir.mkdir(parents=True, exist_ok=True)
        os.symlink(target, devdir / "driver")
    return root


def test_auto_fake_sysfs_infiniband(tmp_path: Path) -> None:
    root = fake_sysfs(
        tmp_path,
        net={"lo": "unknown", "eth0": "up", "ib0": "up"},
        rdma={"mlx5_0": [("ACTIVE", "InfiniBand")], "mlx5_1": [("DOWN", "InfiniBand")]},
    )
    r = resolve_preset("auto", sysfs_root=root)
    assert r.name == "ib" and r.env == {}
    assert "mlx5_0:1" in r.reason and "mlx5_1" not in r.reason


def test_auto_fake_sysfs_roce(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, net={"eth0": "up"}, rdma={"mlx5_0": [("ACTIVE", "Ethernet")]})
    assert resolve_preset("auto", sysfs_root=root).name == "roce"


def test_auto_fake_sysfs_efa_wins(tmp_path: Path) -> None:
    root = fake_sysfs(
        tmp_path,
        net={"ens32": "up"},
        rdma={"rdmap16s27": [("ACTIVE", "Unspecified")]},
        drivers={"rdmap16s27": "efa"},
    )
    r = resolve_preset("auto", sysfs_root=root)
    assert r.name == "efa" and r.env == {} and "rdmap16s27" in r.reason


def test_auto_fake_sysfs_ports_down_falls_back_to_sockets(tmp_path: Path) -> None:
    root = fake_sysfs(
        tmp_path,
        net={"docker0": "up", "eth0": "down", "ens5": "up", "lo": "unknown"},
        rdma={"mlx5_0": [("DOWN", "InfiniBand")]},
    )
    r = resolve_preset("auto", sysfs_root=root)
    assert r.name == "ethernet"
    assert r.env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=ens5"}
    assert "no port ACTIVE" in r.reason


def test_auto_fake_sysfs_nothing_usable(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, net={"lo": "unknown", "docker0": "up", "virbr0": "up"})
    r = resolve_preset("auto", sysfs_root=root)
    assert r.name == "none" and r.env == {} and "no RDMA device" in r.reason
    # no sysfs at all (a container without /sys/class): still an answer, never an exception
    assert resolve_preset("auto", sysfs_root=tmp_path / "missing").name == "none"


def test_debug_overlay_combines_with_detected_fabric(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, net={"eth0": "up"}, rdma={"mlx5_0": [("ACTIVE", "InfiniBand")]})
    r = resolve_preset("debug", sysfs_root=root)
    assert r.name == "ib+debug"
    assert r.env == dict(PRESETS["debug"].env)
    assert r.env["NCCL_DEBUG"] == "INFO" and r.env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    # the login node may only know the overlay; auto knows nothing before it reaches a node
    assert static_preset_env("debug") == dict(PRESETS["debug"].env)
    assert static_preset_env("auto") == {}


def test_static_presets_follow_mechanics_d() -> None:
    assert PRESETS["ib"].env == {} and PRESETS["roce"].env == {} and PRESETS["nvlink"].env == {}
    assert PRESETS["efa"].env == {} and PRESETS["none"].env == {}
    eth = PRESETS["ethernet"].env
    assert eth["NCCL_IB_DISABLE"] == "1" and eth["NCCL_SOCKET_IFNAME"].startswith("^lo")
    assert all(p.description and "\n" not in p.description for p in PRESETS.values())


def test_every_preset_validates_clean() -> None:
    for p in PRESETS.values():
        assert validate_nccl_env(p.env) == [], p.name


def test_user_env_wins_over_preset(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, net={"eth0": "up"})
    cfg = NcclConfig(preset="auto", env={"NCCL_SOCKET_IFNAME": "=eth1", "NCCL_DEBUG": "WARN"})
    r = nccl_environment(cfg, sysfs_root=root)
    assert r.env == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "=eth1", "NCCL_DEBUG": "WARN"}
    assert "nccl.env overrides NCCL_SOCKET_IFNAME" in r.reason
    assert nccl_environment(NcclConfig(preset="none"), sysfs_root=root).env == {}


def test_unknown_preset_is_bad_input() -> None:
    with pytest.raises(UserInputError, match="did you mean ethernet"):
        resolve_preset("ethernett")


def test_socket_ifname_matching() -> None:
    ifs = [NetInterface(n, "up") for n in ("lo", "docker0", "eth0", "eth1", "ens5")]
    names = lambda spec: [i.name for i in match_socket_ifname(spec, ifs)]  # noqa: E731
    assert names("eth") == ["eth0", "eth1"]
    assert names("=eth0") == ["eth0"]
    assert names("=eth") == []
    assert names("^docker,lo") == ["eth0", "eth1", "ens5"]
    assert names("^=eth0") == ["docker0", "eth1", "ens5"]
    assert names("eth0,ens") == ["eth0", "ens5"]


# ---- validation -----------------------------------------------------------------------------


def one(env: dict[str, str]) -> nccl.NcclIssue:
    issues = validate_nccl_env(env)
    assert len(issues) == 1, issues
    return issues[0]


@pytest.mark.parametrize(
    ("name", "value", "replacement", "words"),
    [
        ("NCCL_NET_GDR_LEVEL", "PBH", "PHB", "did you mean PHB"),
        ("NCCL_P2P_LEVEL", "phb", "PHB", "case-sensitively"),
        ("NCCL_P2P_LEVEL", "NVLINK", "NVL", "silently ignores"),
        ("NCCL_TREE_THRESHOLD", "0", "NCCL_ALGO", "removed"),
        ("NCCL_LL_THRESHOLD", "0", "NCCL_PROTO", "removed"),
        ("NCCL_TIMEOUT", "1800", None, "init_process_group"),
        ("NCCL_IB_CUDA_SUPPORT", "1", "NCCL_NET_GDR_LEVEL", "removed"),
        ("NCCL_SOCKET_IFNAM", "eth0", "NCCL_SOCKET_IFNAME", "did you mean NCCL_SOCKET_IFNAME"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLNG", "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "did you mean"),
        ("NCCL_DEBUG", "DEBUG", None, "not a level"),
        ("NCCL_DEBUG_SUBSYS", "INIT,NETWORK", None, "NETWORK"),
        ("NCCL_IB_DISABLE", "yes", None, "not 0 or 1"),
        ("NCCL_BUFFSIZE", "4MB", None, "not an integer"),
        ("NCCL_IB_TIMEOUT", "40", None, "outside 1..31"),
        ("NCCL_IB_RETRY_CNT", "9", None, "outside 0..7"),
        ("NCCL_ALGO", "Ring,Trees", "Tree", "did you mean Tree"),
        ("NCCL_PROTO", "LL256", "LL128", "'LL256'"),
        ("NCCL_SOCKET_FAMILY", "inet6", "AF_INET6", "AF_INET"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "4", None, "0, 1, 2, 3"),
        ("TORCH_DISTRIBUTED_DEBUG", "FULL", None, "OFF, INFO, DETAIL"),
        ("TORCH_NCCL_BLOCKING_WAIT", "maybe", None, "torch refuses"),
        ("NCCL_NTHREADS", "100", None, "64, 128, 256, 512"),
    ],
)
def test_certainly_wrong_values_are_errors(
    name: str, value: str, replacement: str | None, words: str
) -> None:
    issue = one({name: value})
    assert issue.severity == "error" and issue.name == name
    assert words in issue.message
    assert issue.replacement == replacement


@pytest.mark.parametrize(
    ("name", "replacement"),
    [
        ("NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        ("NCCL_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT"),
        ("NCCL_DESYNC_DEBUG", "TORCH_NCCL_DESYNC_DEBUG"),
        ("NCCL_ENABLE_TIMING", "TORCH_NCCL_ENABLE_TIMING"),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"),
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"),
        ("NCCL_MAX_NRINGS", "NCCL_MAX_NCHANNELS"),
    ],
)
def test_deprecated_aliases_are_warnings_with_replacement(name: str, replacement: str) -> None:
    value = "/tmp/fr_" if name.endswith("FILE") else "1"
    issue = one({name: value})
    assert issue.severity == "warning" and issue.replacement == replacement
    assert replacement in issue.message


def test_deprecated_alias_value_is_still_checked() -> None:
    issues = validate_nccl_env({"NCCL_ASYNC_ERROR_HANDLING": "7"})
    assert [i.severity for i in issues] == ["error", "warning"]


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("NCCL_FANCY_NEW_KNOB", "1", "not known"),  # maybe newer than the table: doubtful
        ("NCCL_IB_DISABLE", "true", "write 1"),  # NCCL 2.32 reads it, older releases ignore it
        ("NCCL_P2P_LEVEL", "9", "legacy"),
        ("RDMAV_FORK_SAFE", "1", "never"),
        ("OMP_NUM_THREADS", "4", "launch.env"),
        ("NCCL_DEBUG_FILE", "~/nccl.%h.log", "absolute"),
        ("NCCL_SOCKET_IFNAME", "", "empty"),
    ],
)
def test_doubtful_things_are_warnings(name: str, value: str, words: str) -> None:
    issue = one({name: value})
    assert issue.severity == "warning" and words in issue.message


def test_combinations() -> None:
    issues = validate_nccl_env(
        {
            "NCCL_P2P_DISABLE": "1",
            "NCCL_P2P_LEVEL": "NVL",
            "NCCL_IB_DISABLE": "1",
            "NCCL_IB_HCA": "mlx5_0",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_BUFFER_SIZE": "0",
            "NCCL_BLOCKING_WAIT": "1",
            "TORCH_NCCL_BLOCKING_WAIT": "1",
        }
    )
    assert all(i.severity == "warning" for i in issues)
    text = " | ".join(str(i) for i in issues)
    assert "forces LOC" in text and "NCCL_IB_HCA have no effect" in text
    assert "flight recorder is off" in text and "ignored because TORCH_NCCL_BLOCKING_WAIT" in text


def test_real_world_settings_raise_no_error() -> None:
    """Settings from working cluster scripts: nothing here may become a config error (exit 2)."""
    env = {
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_3:1",
        "NCCL_SOCKET_IFNAME": "^docker,lo",
        "NCCL_IB_GID_INDEX": "3",
        "NCCL_IB_TC": "106",
        "NCCL_IB_SL": "3",
        "NCCL_IB_TIMEOUT": "22",
        "NCCL_IB_RETRY_CNT": "7",
        "NCCL_IB_QPS_PER_CONNECTION": "4",
        "NCCL_NET_GDR_LEVEL": "PHB",
        "NCCL_P2P_LEVEL": "NVL",
        "NCCL_CROSS_NIC": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_DEBUG": "warn",
        "NCCL_DEBUG_SUBSYS": "^INIT,ENV",
        "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p.log",
        "NCCL_ALGO": "allreduce:ring,tree;broadcast:ring",
        "NCCL_PROTO": "^LL128",
        "NCCL_NET": "AWS Libfabric",
        "NCCL_BUFFSIZE": "0x800000",
        "NCCL_NSOCKS_PERTHREAD": "4",
        "NCCL_SOCKET_NTHREADS": "2",
        "NCCL_MIN_NCHANNELS": "4",
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_TOPO_FILE": "/opt/topo.xml",
        "NCCL_NET_PLUGIN": "aws-ofi",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "true",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_DISTRIBUTED_DEBUG": "detail",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_HUGE_PAGE": "0",
        "OFI_NCCL_PROTOCOL": "RDMA",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    assert validate_nccl_env(env) == []


def test_errors_come_first() -> None:
    issues = validate_nccl_env({"NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_TIMEOUT": "5"})
    assert [i.severity for i in issues] == ["error", "warning"]
    assert str(issues[0]).startswith("NCCL_TIMEOUT: ")


def test_detect_fabric_on_this_machine_never_raises() -> None:
    r = detect_fabric()
    assert r.name in ("ib", "roce", "efa", "ethernet", "none") and r.reason


def test_cli_nccl_presets_json(capsys: pytest.CaptureFixture[str]) -> None:
    from hpclaunch.cli import main

    assert main(["nccl", "presets", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in out["presets"]] == list(PRESETS)
    assert out["auto"]["name"] in ("ib", "roce", "efa", "ethernet", "none") and out["auto"]["reason"]


def test_cli_nccl_presets_table(capsys: pytest.CaptureFixture[str]) -> None:
    from hpclaunch.cli import main

    assert main(["nccl", "presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "auto on this machine:" in out
