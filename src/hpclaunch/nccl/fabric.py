"""What a node shows of its network fabric, read from sysfs: RDMA ports, EFA devices, interfaces."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class IbPort:
    device: str
    port: str
    state: str  # "ACTIVE", "DOWN", "INIT", ... (from "4: ACTIVE")
    link_layer: str  # "InfiniBand" | "Ethernet" | ...
    driver: str | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class NetInterface:
    name: str
    operstate: str  # "up", "down", "unknown", ...

    @property
    def up(self) -> bool:
        return self.operstate == "up"


# Interfaces NCCL should never carry traffic over: loopback, container and VM bridges/veths.
_VIRTUAL_PREFIXES = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "cali", "ifb", "tun", "tap")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def infiniband_ports(sysfs_root: Path = Path("/sys")) -> list[IbPort]:
    """Every port of every RDMA device under ``/sys/class/infiniband`` (IB, RoCE and EFA alike)."""
    base = sysfs_root / "class" / "infiniband"
    ports: list[IbPort] = []
    try:
        devices = sorted(base.iterdir())
    except OSError:
        return []
    for dev in devices:
        driver = None
        with contextlib.suppress(OSError):
            driver = (dev / "device" / "driver").resolve(strict=True).name
        try:
            port_dirs = sorted((dev / "ports").iterdir())
        except OSError:
            port_dirs = []
        for port in port_dirs:
            state = _read(port / "state") or ""
            state = state.split(":", 1)[-1].strip()  # "4: ACTIVE" -> "ACTIVE"
            link = _read(port / "link_layer") or ""
            ports.append(IbPort(dev.name, port.name, state, link, driver))
        if not port_dirs:
            ports.append(IbPort(dev.name, "", "", "", driver))
    return ports


def efa_devices(ports: list[IbPort]) -> list[str]:
    return sorted({p.device for p in ports if p.driver == "efa" or p.device.startswith("efa")})


def net_interfaces(sysfs_root: Path = Path("/sys")) -> list[NetInterface]:
    base = sysfs_root / "class" / "net"
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError:
        return []
    return [NetInterface(n, (_read(base / n / "operstate") or "unknown").lower()) for n in names]


def pick_socket_interface(interfaces: list[NetInterface]) -> NetInterface | None:
    """The first interface that is up and not loopback, a container/VM bridge or a tunnel."""
    for iface in interfaces:
        if iface.up and not iface.name.startswith(_VIRTUAL_PREFIXES):
            return iface
    return None


def match_socket_ifname(spec: str, interfaces: list[NetInterface]) -> list[NetInterface]:
    """The interfaces NCCL would consider for ``NCCL_SOCKET_IFNAME=spec``.

    ``eth`` prefix, ``=eth0`` exact, ``^docker,lo`` exclude prefixes, ``^=docker0`` exclude exact.
    Loopback only counts when named explicitly (NCCL uses it only as a last resort).
    """
    spec = spec.strip()
    exclude = spec.startswith("^")
    tokens = [t.strip() for t in spec.lstrip("^").split(",") if t.strip()]

    def hit(name: str) -> bool:
        for tok in tokens:
            if tok.startswith("="):
                if name == tok[1:]:
                    return True
            elif name.startswith(tok):
                return True
        return False

    if exclude:
        return [i for i in interfaces if not hit(i.name) and not i.name.startswith("lo")]
    return [i for i in interfaces if hit(i.name)]
