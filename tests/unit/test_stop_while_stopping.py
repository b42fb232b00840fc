"""`hpclaunch stop` while an attempt is already stopping: for the scheduler (its time limit's warning,
a preemption) the run would be continued, so the user's stop is taken (the decider's or the next
attempt's: the run ends instead); for the user's own stop there is nothing more to stop. CI saw the
first refused as "nothing to stop: the run has ended (stopping)" and the run went on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hpclaunch.cli.stop_cmd import _stoppable

pytestmark = pytest.mark.fast


def view(state: str, cause: str | None, *, in_flight: bool = True) -> Any:
    return SimpleNamespace(state=state, in_flight=in_flight, attempts=[SimpleNamespace(cause=cause)])


@pytest.mark.parametrize(
    ("state", "cause", "stoppable"),
    [
        ("running", None, True),
        ("stopping", "timeout", True),
        ("stopping", "preemption", True),
        ("stopping", "user", False),
        ("finishing", None, False),
        ("cancelling", "cancelled", False),
    ],
)
def test_a_stop_is_taken_while_the_run_would_still_go_on(
    state: str, cause: str | None, stoppable: bool
) -> None:
    assert _stoppable(view(state, cause)) is stoppable
    assert _stoppable(view(state, cause, in_flight=False)) is False
