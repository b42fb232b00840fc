"""A node's death seen by the first evidence: a TCP connection between agents, which the kernel
closes the moment an agent's process dies.

The heartbeat (``allocation``) calls a node dead only after its counter stayed unchanged for
``DEAD_AFTER_S`` (8 s) on the observer's clock: that is what it takes for a silent node (power
lost, a kernel hang, a cut link). But most deaths are not silent: when a node's processes die
(the OOM killer, a SIGKILL, a crash of the node agent's Python), its kernel closes their sockets,
and a peer holding a connection to it reads end-of-file at once, as the ranks' own gloo/NCCL
connections do. So every agent listens on a TCP port (``Listener``; its address in
``RUN/agents/<job>/links/<host>``, written once), and an agent that watches another (the decider
each training node it waits for, every other agent the decider) holds a connection to it
(``Links``). End-of-file on it is the first evidence; it is confirmed by connecting again: refused
(nothing listens there any more) is dead, at once; accepted is alive (the connection broke, not
the agent); no answer within ``CONFIRM_S`` is no evidence, and the heartbeat window decides.

Nothing is sent on these connections: they carry no protocol and cost nothing while both ends
live (one descriptor each; the decider holds one per node).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from ..fsutil import atomic_write_text, poll_json

CONNECT_S = 2.0  # a first connection to an agent that does not answer: no link, the heartbeat decides
CONFIRM_S = 1.0  # the reconnection that tells a dead agent from a broken connection
RETRY_S = 5.0  # an agent not listening yet (still starting) is asked again after this


class Listener:
    """This agent's end: accepts the watchers' connections and keeps them open while it lives."""

    def __init__(self, folder: Path, host: str, address: str) -> None:
        self.sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, 0))
        self.sock.listen(1024)
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="hpclaunch-links", daemon=True)
        self._thread.start()
        port = self.sock.getsockname()[1]
        atomic_write_text(folder / host, json.dumps({"address": address, "port": port}) + "\n")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed: this agent is leaving
            self._held.append(conn)

    def close(self) -> None:
        # shutdown first: a close alone leaves the socket listening while the accepting thread
        # still waits in accept(), and a watcher's confirming connection would be accepted there.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        # The accepting thread ends at its next accept(); a connection it accepted meanwhile is in
        # ``_held`` by then, and closed below with the others (else it stayed open: a live link).
        self._thread.join(timeout=5.0)
        with contextlib.suppress(OSError):
            self.sock.close()
        for conn in self._held:
            with contextlib.suppress(OSError):
                conn.close()


class Links:
    """The watching end: one connection per watched agent, made on first need (``watch``)."""

    def __init__(self, folder: Path, me: str) -> None:
        self.folder = folder
        self.me = me
        self._conns: dict[str, socket.socket] = {}
        self._dead: set[str] = set()
        self._next_try: dict[str, float] = {}  # hosts not listening yet: when to ask again

    def watch(self, hosts: Iterable[str]) -> None:
        """Connect to each of ``hosts`` not linked yet (a refused connection is a death)."""
        for host in hosts:
            self.dead(host)

    def ended(self, host: str) -> bool:
        """Evidence on an existing connection only (no new connection is made): ``host`` is dead."""
        return host in self._dead or (host in self._conns and self.dead(host))

    def linked(self, host: str) -> bool:
        """A connection to ``host``'s agent is open (as last looked at by ``dead``): evidence that it
        lives, since its kernel closes it when the agent dies."""
        return host in self._conns and host not in self._dead

    def dead(self, host: str) -> bool:
        """Whether ``host``'s agent is known dead now: its connection ended and nothing listens
        where it did. False is "no evidence", never "alive" (the heartbeat still decides)."""
        if host == self.me or host in self._dead:
            return host in self._dead
        conn = self._conns.get(host)
        if conn is None:
            if time.monotonic() >= self._next_try.get(host, 0.0):
                self._link(host, CONNECT_S)
            return host in self._dead
        if not _closed(conn):
            return False
        self._drop(host)
        self._link(host, CONFIRM_S)
        return host in self._dead

    def _link(self, host: str, timeout: float) -> None:
        """Connect to ``host``'s listener: refused (nothing listens where its agent did) is its
        death; no answer, or no address yet (still starting), is no evidence: asked again later."""
        where = poll_json(self.folder / host)
        try:
            if not isinstance(where, dict):
                raise LookupError(host)
            conn = socket.create_connection((str(where["address"]), int(where["port"])), timeout)
            # Non-blocking from now on: a socket with a timeout waits for data before any recv,
            # MSG_DONTWAIT or not, and the peek in ``_closed`` must never wait.
            conn.setblocking(False)
            self._conns[host] = conn
        except ConnectionRefusedError:
            self._dead.add(host)
        except (OSError, LookupError, KeyError, ValueError):
            self._next_try[host] = time.monotonic() + RETRY_S

    def _drop(self, host: str) -> None:
        conn = self._conns.pop(host, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.close()

    def close(self) -> None:
        for host in list(self._conns):
            self._drop(host)


def _closed(conn: socket.socket) -> bool:
    """The peer closed (or reset) the connection: a peek that does not wait reads nothing (end of
    file) or fails. One call, no ``select``: ``select()`` refuses a descriptor >= FD_SETSIZE (1024),
    and a decider holds one per agent (``preflight/fds.py``), so hundreds of agents pass it."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False  # nothing to read, the connection still open
    except OSError:
        return True
