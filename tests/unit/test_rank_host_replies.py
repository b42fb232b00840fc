"""The rank host answers on marked lines of its stderr (every container runtime carries stderr; not
every one passes another descriptor). The agent's reader takes the replies out and keeps the rest,
a line another process left unfinished in front of a reply included, for the node log."""

from __future__ import annotations

import io
import json
import queue

import pytest

from hpclaunch.jobs.rank_host import RankHost
from hpclaunch.rundir.attempt_records import REPLY_MARK

pytestmark = pytest.mark.fast


class _Sink:
    def __init__(self) -> None:
        self.lines: list[bytes] = []

    def write(self, line: bytes) -> None:
        self.lines.append(line)


def test_replies_are_taken_out_of_stderr_and_the_rest_is_logged() -> None:
    host = RankHost.__new__(RankHost)  # (no process: only the reader is under test)
    host.sink = _Sink()  # type: ignore[assignment]
    host._replies = queue.Queue()
    mark = REPLY_MARK.encode()
    stream = io.BytesIO(
        b"torch: a warning\n"
        + mark + json.dumps({"ready": {"pid": 7, "forkserver": 8}}).encode() + b"\n"
        + b"half a line from a rank" + mark + json.dumps({"done": {"state": "succeeded"}}).encode() + b"\n"
        + b"the last line\n"
    )  # fmt: skip
    host._tee(stream, False, True)
    assert host._replies.get_nowait() == {"ready": {"pid": 7, "forkserver": 8}}
    assert host._replies.get_nowait() == {"done": {"state": "succeeded"}}
    assert host.sink.lines == [b"torch: a warning\n", b"half a line from a rank\n", b"the last line\n"]  # type: ignore[attr-defined]


def test_a_long_error_still_fits_one_atomic_write(capfd: pytest.CaptureFixture[str]) -> None:
    from hpclaunch.rank.host import send

    send(done={"state": "failed", "returncode": 1, "error": "x" * 20000})
    err = capfd.readouterr().err
    assert err.startswith(REPLY_MARK) and err.endswith("\n") and len(err.encode()) <= 4096
    assert json.loads(err.removeprefix(REPLY_MARK))["done"]["state"] == "failed"
