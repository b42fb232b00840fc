"""Addresses of the nodes of an allocation: where the rendezvous is, which interface gloo uses.

The scheduler says where a host is (``Scheduler.node_address``: SLURM's NodeAddr, else DNS); these
helpers fail loudly instead of falling back to localhost: a multi-node job that rendezvouses on
loopback hangs instead of failing.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

from .protocol import NodeContext, NodeContextError

if TYPE_CHECKING:
    from .protocol import Scheduler


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve_address(host: str) -> str:
    """An IPv4/IPv6 address for ``host`` (an address is returned unchanged)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise NodeContextError(f"cannot resolve host {host!r} ({e.strerror})") from None


def rendezvous_address(ctx: NodeContext, scheduler: Scheduler, head: str | None = None) -> str:
    """The address of ``head`` (default the allocation's first node), where the rendezvous is; on a
    multi-node job a loopback answer is an error, never used."""
    head = head or ctx.head
    addr = scheduler.node_address(head)
    if ctx.num_nodes > 1 and is_loopback(addr):
        raise NodeContextError(
            f"the head node {head} resolves to the loopback address {addr}; the other "
            f"{ctx.num_nodes - 1} node(s) could not reach the rendezvous there",
            where=f"node {ctx.hostname}",
            hint="fix the node's address in DNS//etc/hosts (or SLURM NodeAddr)",
        )
    return addr


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this host (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None
