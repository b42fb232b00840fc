"""Messages between a training process and its writer process: length-prefixed JSON over a Unix
socket, with file descriptors (a staging buffer) passed beside a message (SCM_RIGHTS).

JSON, not pickle: neither side ever unpickles what the other sends. Torch-free.
"""

from __future__ import annotations

import array
import json
import math
import select
import socket
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
_MAX_FDS = 4


class ChannelClosed(EOFError):
    """The other side has gone (exited, killed, or closed its end)."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    payload = json.dumps(message).encode()
    data = _HEADER.pack(len(payload)) + payload
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sent = sock.sendmsg([data], ancillary)
        if sent < len(data):
            sock.sendall(data[sent:])  # the fds went with the first byte
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ChannelClosed(str(e)) from e


def readable(sock: socket.socket, timeout: float | None) -> bool:
    """A message (or the end of the channel) is waiting; ``timeout`` None blocks.

    poll, not select: select() takes no descriptor above 1023, and at a few hundred ranks the gloo
    groups' sockets push this one past it (a ValueError on the first background save). A poll
    object holds no descriptor of its own, unlike an epoll selector. The end of the channel shows
    as POLLHUP, which poll reports whatever was asked for."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return bool(poller.poll(ms))


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The next message and the file descriptors that came with it (blocks until it is whole)."""
    fds: list[int] = []
    header = _read(sock, _HEADER.size, fds)
    (size,) = _HEADER.unpack(header)
    payload = _read(sock, size, fds)
    message = json.loads(payload)
    if not isinstance(message, dict):
        raise ValueError("a channel message must be a JSON object")
    return message, fds


def _read(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    chunks, got = [], 0
    space = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
    while got < n:
        try:
            data, ancillary, _, _ = sock.recvmsg(n - got, space)
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from e
        if not data:
            raise ChannelClosed("the other side closed the channel")
        for level, kind, raw in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got_fds = array.array("i")
                got_fds.frombytes(raw[: len(raw) - len(raw) % got_fds.itemsize])
                fds.extend(got_fds)
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)
