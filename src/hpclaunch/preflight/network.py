"""The ``network`` check: names resolve, the rendezvous can work, and NCCL's interfaces exist.

On the login node the compute nodes' addresses are not known yet (the scheduler picks them), so the
rendezvous part runs in the job: the head node's address must not be loopback on a multi-node run
(the other nodes would dial themselves and hang), the head must be able to bind the rendezvous port,
and the other nodes must reach the head (a refused connection proves the path; a timeout does not).
The NCCL part looks at this node's sysfs: the socket interface the preset or the user named exists
and is up, and InfiniBand ports are ACTIVE when the preset expects InfiniBand.
"""

from __future__ import annotations

import errno
import socket

from ..nccl import infiniband_ports, match_socket_ifname, nccl_environment, net_interfaces
from ..rundir.plan import rdzv_port_for
from ..schedulers.nodes import is_loopback, rendezvous_address, resolve_address
from ..schedulers.protocol import NodeContextError
from ..schedulers.registry import get_scheduler
from .check_context import CheckContext, Findings, Outcome

CONNECT_TIMEOUT_S = 3.0


def check_network(ctx: CheckContext) -> Outcome:
    """Hostname resolution, rendezvous host/port, NCCL socket interface, InfiniBand port state."""
    f = Findings()
    host = ctx.node.hostname if ctx.node is not None else ctx.hostname
    addr = None
    try:
        # on a node: the address the other nodes use (SLURM's NodeAddr, else DNS)
        if ctx.node is not None:
            addr = get_scheduler(ctx.node.scheduler).node_address(host)
        else:
            addr = resolve_address(host)
        f.ok(f"{host} resolves to {addr}")
    except NodeContextError as e:
        if ctx.cfg.scheduler.nodes > 1:
            f.fail(e.message, "fix the name in DNS or /etc/hosts (or SLURM NodeAddr)")
        else:
            f.warn(f"{e.message} (harmless for a one-node run)", "fix the name in DNS or /etc/hosts")
    _rendezvous(ctx, f, addr)
    _fabric(ctx, f)
    return f.outcome()


def _rendezvous(ctx: CheckContext, f: Findings, own_addr: str | None) -> None:
    cfg = ctx.cfg
    if cfg.scheduler.nodes == 1:
        f.skip("single node: the rank host picks its own rendezvous port")
        return
    node = ctx.node
    if node is None:
        if own_addr and is_loopback(own_addr):
            f.warn(
                f"this machine's name resolves to the loopback address {own_addr}: if the compute "
                "nodes are set up the same way, a multi-node rendezvous cannot work (checked on each node)",
                "map each node's name to its network address (DNS, /etc/hosts or SLURM NodeAddr)",
            )
        f.skip("rendezvous host and port are checked on the allocated nodes")
        return
    try:
        head = rendezvous_address(node, get_scheduler(node.scheduler))
    except NodeContextError as e:
        f.fail(e.message, e.hint)
        return
    port = rdzv_port_for(node.attempt, cfg.launch.rdzv_port)  # (this attempt's: the ranks' own)
    if node.is_head:
        problem = port_in_use(port)
        if problem:
            f.fail(
                f"rendezvous port {port} cannot be bound on the head node {node.hostname}: {problem}",
                "another job or a stale rank host holds it; set launch.rdzv_port to a free port",
            )
        else:
            f.ok(f"rendezvous {head}:{port} bindable on the head node")
    else:
        problem = unreachable(head, port)
        if problem:
            f.fail(
                f"the head node {node.head} ({head}:{port}) cannot be reached from {node.hostname}: {problem}",
                "a firewall or a wrong address between the nodes; check the head's address and the port",
            )
        else:
            f.ok(f"head {head}:{port} reachable")


def port_in_use(port: int) -> str | None:
    """Why ``port`` cannot be bound on all interfaces here, or None when it can (bound, then released)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr, port))
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                continue
            return e.strerror or str(e)
        finally:
            s.close()
    return None


def unreachable(addr: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when ``addr`` answers on ``port`` (accepting or refusing), else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return None  # the host answered: the path works, nothing listens yet
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e)


def _fabric(ctx: CheckContext, f: Findings) -> None:
    cfg = ctx.cfg
    if cfg.backend == "gloo":
        _gloo_ifname(ctx, f)
        return
    if not ctx.sees_compute_hardware:
        f.skip("NCCL interfaces are checked on each node")
        return
    resolved = nccl_environment(cfg.nccl, sysfs_root=ctx.sysfs_root)
    spec = resolved.env.get("NCCL_SOCKET_IFNAME")
    if spec:
        interfaces = net_interfaces(ctx.sysfs_root)
        matched = match_socket_ifname(spec, interfaces)
        names = ", ".join(i.name for i in interfaces) or "none"
        if not matched:
            f.fail(
                f"NCCL_SOCKET_IFNAME={spec} matches no interface on this node (it has {names})",
                "fix NCCL_SOCKET_IFNAME (prefix, =exact, ^exclude) or use nccl.preset auto",
            )
        elif not any(i.up for i in matched):
            f.fail(
                f"NCCL_SOCKET_IFNAME={spec} matches {', '.join(i.name for i in matched)} but none is up",
                "bring the interface up or point NCCL_SOCKET_IFNAME at one that is",
            )
    if resolved.name.split("+")[0] in ("ib", "roce"):
        want = "InfiniBand" if resolved.name.startswith("ib") else "Ethernet"
        ports = [p for p in infiniband_ports(ctx.sysfs_root) if p.link_layer in (want, "")]
        if not any(p.active for p in ports):
            seen = ", ".join(f"{p.device}:{p.port} {p.state or '?'}" for p in ports) or "no RDMA device"
            f.fail(
                f"preset {resolved.name} expects {want} ports but none is ACTIVE ({seen})",
                "check the HCA (ibstat), or use nccl.preset auto / ethernet on nodes without it",
            )
    f.ok(f"NCCL preset {resolved.name} ({resolved.reason})")


def _gloo_ifname(ctx: CheckContext, f: Findings) -> None:
    spec = ctx.cfg.launch.env.get("GLOO_SOCKET_IFNAME")
    if not spec or not ctx.sees_compute_hardware:
        return
    have = {i.name for i in net_interfaces(ctx.sysfs_root)}
    missing = [n for n in (s.strip() for s in spec.split(",")) if n and n not in have]
    if missing:
        f.fail(
            f"GLOO_SOCKET_IFNAME names {', '.join(missing)}, not an interface of this node",
            f"interfaces here: {', '.join(sorted(have)) or 'none'}",
        )
