"""Issue 49: ``select.select`` came back into the links (``jobs/links.py``), and it refuses a descriptor
of 1024 or more (``ValueError: filedescriptor out of range in select()``): the decider holds one
connection per agent, so it died once it watched about a thousand agents. The link check is one
non-blocking peek now; here on real connections moved above 1024."""

from __future__ import annotations

import os
import re
import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclaunch.jobs.links import Links, Listener, _closed

pytestmark = pytest.mark.fast

HIGH = 1500  # above FD_SETSIZE (1024)
SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"


@pytest.fixture
def room_above_1024() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH + 10:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves no room above {HIGH}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, HIGH + 10), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def moved_high(sock: socket.socket, fd: int) -> socket.socket:
    """``sock``'s connection on descriptor ``fd`` (the original closed)."""
    os.dup2(sock.fileno(), fd)
    sock.close()
    return socket.socket(fileno=fd)


def test_a_link_on_a_descriptor_above_1024_is_open_then_closed_never_an_error(room_above_1024: None) -> None:
    mine, theirs = socket.socketpair()
    high = moved_high(mine, HIGH)
    try:
        assert high.fileno() >= 1024
        assert _closed(high) is False  # open, nothing to read
        theirs.sendall(b"x")  # (nothing is ever sent; data waiting is still an open link)
        assert _closed(high) is False
        theirs.close()
        high.recv(1)
        assert _closed(high) is True  # the peer's end of file
    finally:
        high.close()


def test_the_decider_sees_a_dead_agent_on_a_connection_above_1024(
    tmp_path: Path, room_above_1024: None
) -> None:
    agent = Listener(tmp_path, "n2", "127.0.0.1")
    links = Links(tmp_path, "n1")
    links.watch(["n2"])
    assert links._conns["n2"].gettimeout() == 0.0  # non-blocking: the peek never waits for data
    links._conns["n2"] = moved_high(links._conns["n2"], HIGH)
    assert not links.dead("n2")  # alive: no error, no evidence
    agent.close()  # the agent's process is gone: its connections closed, nothing listens
    assert links.dead("n2") and links.ended("n2")
    links.close()


def test_no_select_select_in_the_package() -> None:
    """``select.select`` has a descriptor ceiling of 1024; ``poll`` and peeks have none."""
    found = [
        f"{p.relative_to(SRC)}:{n}"
        for p in SRC.rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bselect\.select\(", line)
    ]
    assert found == []
