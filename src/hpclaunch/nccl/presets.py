"""Named NCCL presets and ``auto``: the preset a node's fabric calls for.

The presets are starting points, not tuning: on a healthy InfiniBand fabric NCCL needs no variables
at all, and most cargo-culted ones are harmful. Facts behind every value: shared/reference/mechanics.md
section D (NCCL v2.30 source, torch 2.13, aws-ofi-nccl docs).

``auto`` runs on each node (the node agent calls :func:`nccl_environment`), because the login node
and the compute nodes seldom share a fabric. Pure Python: no torch import, sysfs read only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserInputError, did_you_mean
from .fabric import IbPort, efa_devices, infiniband_ports, net_interfaces, pick_socket_interface


@dataclass(frozen=True)
class Preset:
    name: str
    env: Mapping[str, str]
    description: str  # one line: what it sets and why
    when: str  # one line: when to pick it


# Exclusion list (prefixes) for the static ethernet preset: works on every node whatever its NIC is
# called. ``auto`` replaces it with the exact interface it found on the node.
_SOCKET_EXCLUDE = "^lo,docker,virbr,veth"

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "ib",
            {},
            "InfiniBand verbs: NCCL finds the HCAs and GPUDirect RDMA itself; set nothing "
            "(pin NCCL_IB_HCA only if needed)",
            "clusters with InfiniBand (mlx5_* ports with link_layer InfiniBand)",
        ),
        Preset(
            "roce",
            {},
            "RoCE: as ib; NCCL >= 2.21.5 picks the RoCEv2 GID itself (NCCL_IB_GID_INDEX only for "
            "older NCCL or odd GID tables; NCCL_IB_TC/SL from the switch QoS setup)",
            "Ethernet fabrics with RDMA NICs (ports with link_layer Ethernet)",
        ),
        Preset(
            "ethernet",
            {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": _SOCKET_EXCLUDE},
            "TCP sockets only: IB verbs off, NCCL traffic kept off loopback/docker/bridge interfaces",
            "plain Ethernet/TCP clusters without RDMA",
        ),
        Preset(
            "nvlink",
            {},
            "single node over NVLink/NVSwitch: nothing to set (NCCL_P2P_LEVEL=NVL only to forbid PCIe P2P)",
            "one node with NVLink-connected GPUs",
        ),
        Preset(
            "efa",
            {},
            "AWS EFA with aws-ofi-nccl >= 1.7 and libfabric >= 1.18: set nothing (never RDMAV_FORK_SAFE; "
            "FI_EFA_USE_DEVICE_RDMA only for plugin 1.6.x)",
            "AWS p4d/p5 instances with EFA devices",
        ),
        Preset(
            "debug",
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,BOOTSTRAP,ENV,NET,GRAPH",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_FR_BUFFER_SIZE": "20000",
                "TORCH_NCCL_DESYNC_DEBUG": "1",
                "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            },
            "overlay on the detected fabric: NCCL INFO logs (transport chosen: NET/IB vs NET/Socket), "
            "flight-recorder dump and desync report on timeout, DETAIL collective checks (slow)",
            "a hang or NCCL error to diagnose; never for production runs",
        ),
        Preset(
            "none",
            {},
            "set no variable at all; NCCL's own defaults and whatever the site exports",
            "sites whose modules already export tuned NCCL settings",
        ),
    )
}

PRESET_NAMES = ("auto", *PRESETS)


@dataclass(frozen=True)
class ResolvedPreset:
    """What a node will export: the preset's name (e.g. ``ethernet+debug``), variables and why."""

    name: str
    env: dict[str, str]
    reason: str

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "env": dict(self.env), "reason": self.reason}


def static_preset_env(name: str) -> dict[str, str]:
    """The variables a preset sets without looking at any node (``auto``: none; ``debug``: the overlay).

    What the login node may put into a job script; the fabric part of ``auto``/``debug`` is only
    known on the node and comes from :func:`nccl_environment` there.
    """
    if name == "auto":
        return {}
    return dict(_preset(name).env)


def resolve_preset(name: str, *, sysfs_root: Path = Path("/sys")) -> ResolvedPreset:
    """The variables of preset ``name`` on this node; ``auto`` and ``debug`` look at ``sysfs_root``."""
    if name == "auto":
        return detect_fabric(sysfs_root)
    if name == "debug":
        base = detect_fabric(sysfs_root)
        env = {**base.env, **PRESETS["debug"].env}
        return ResolvedPreset(f"{base.name}+debug", env, f"debug overlay on {base.name}: {base.reason}")
    preset = _preset(name)
    return ResolvedPreset(preset.name, dict(preset.env), f"preset {preset.name}: {preset.description}")


def nccl_environment(nccl_cfg: Any, *, sysfs_root: Path = Path("/sys")) -> ResolvedPreset:
    """Preset variables merged with ``nccl.env`` (the user's values win) for this node."""
    resolved = resolve_preset(nccl_cfg.preset, sysfs_root=sysfs_root)
    user = dict(nccl_cfg.env)
    if not user:
        return resolved
    overridden = sorted(k for k in user if k in resolved.env and resolved.env[k] != user[k])
    reason = resolved.reason
    if overridden:
        reason += f"; nccl.env overrides {', '.join(overridden)}"
    return ResolvedPreset(resolved.name, {**resolved.env, **user}, reason)


def flight_recorder_env(dump_stem: str, pipe_stem: str) -> dict[str, str]:
    """torch's NCCL flight recorder, kept on for every preset but ``none``: each rank keeps its last
    collectives in a ring buffer and writes them to ``<dump_stem><rank>`` on a collective timeout or
    when the node agent's watchdog writes to ``<pipe_stem><rank>.pipe`` (a hang). The buffer costs
    host memory only; current names (torch 2.13 also reads TORCH_NCCL_TRACE_BUFFER_SIZE and
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE, which ``validate`` reports as deprecated)."""
    return {
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": dump_stem,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipe_stem,
    }


def _preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserInputError(
            f"unknown NCCL preset {name!r}{did_you_mean(name, PRESET_NAMES)}",
            where="nccl.preset",
            hint=f"presets: {', '.join(PRESET_NAMES)}",
        ) from None


def detect_fabric(sysfs_root: Path = Path("/sys")) -> ResolvedPreset:
    """``auto``: EFA, else active IB/RoCE ports, else an up socket interface, else nothing."""
    ports = infiniband_ports(sysfs_root)
    efa = efa_devices(ports)
    if efa:
        return ResolvedPreset("efa", dict(PRESETS["efa"].env), f"EFA device(s) {', '.join(efa)}")
    rdma = [p for p in ports if p.device not in efa]
    active = [p for p in rdma if p.active]
    ib = [p for p in active if p.link_layer == "InfiniBand"]
    roce = [p for p in active if p.link_layer == "Ethernet"]
    if ib:
        return ResolvedPreset("ib", dict(PRESETS["ib"].env), f"InfiniBand port(s) ACTIVE: {_ports(ib)}")
    if roce:
        return ResolvedPreset("roce", dict(PRESETS["roce"].env), f"RoCE port(s) ACTIVE: {_ports(roce)}")
    note = f"RDMA device(s) {_ports(rdma)} present but no port ACTIVE; " if rdma else ""
    iface = pick_socket_interface(net_interfaces(sysfs_root))
    if iface is not None:
        env = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": f"={iface.name}"}
        return ResolvedPreset(
            "ethernet", env, f"{note}no RDMA port ACTIVE; socket interface {iface.name} is up"
        )
    return ResolvedPreset(
        "none", {}, f"{note}no RDMA device and no usable socket interface found; NCCL defaults"
    )


def _ports(ports: list[IbPort]) -> str:
    return ", ".join(f"{p.device}:{p.port}" if p.port else p.device for p in ports)
