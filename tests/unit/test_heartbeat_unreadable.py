"""Issue 49, M2: a heartbeat that the observer cannot read for 8 s made a live agent dead, its link up
all the while: the failed read was taken as "no change" and aged the observation. An NFS hiccup on
the observer's side then spent spares and exclusion budgets on healthy nodes. Now only a read that
succeeds ages an observation, and an open link is evidence of life.

The files and the link are real (a real ``Listener``, a heartbeat file made unreadable by putting a
directory in its place, EISDIR, as ESTALE or EIO would be), the agent beats by hand and the
observer's clock is a fake that the test moves: 15 s of unreadable heartbeat, half-second looks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpclaunch.jobs.allocation import DEAD_AFTER_S, Allocation, Roster
from hpclaunch.rundir import RunPaths

pytestmark = pytest.mark.fast

HOSTS = ("n1", "n2")
UNREADABLE_S = 15.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pair(tmp_path: Path, *, linked: bool) -> tuple[Allocation, Allocation, Clock]:
    """The observer (n1) and the watched agent (n2), with or without a link between them."""
    clock = Clock()
    observer = Allocation(RunPaths(tmp_path), "7.0", "n1", HOSTS, clock=clock)
    agent = Allocation(RunPaths(tmp_path), "7.0", "n2", HOSTS)
    agent.beats.mkdir(parents=True, exist_ok=True)
    agent.beat()
    if linked:
        agent.listen("127.0.0.1")
        observer.listen("127.0.0.1")
        observer.watch(["n2"])
        assert observer.links is not None and observer.links.linked("n2")
    return observer, agent, clock


def unreadable(agent: Allocation) -> Path:
    """Put a directory where the agent's heartbeat file is (its writes go on into the file, set aside)."""
    path = agent.beats / agent.host
    aside = path.with_name(".aside")
    os.rename(path, aside)
    path.mkdir()
    return aside


def readable_again(agent: Allocation, aside: Path) -> None:
    path = agent.beats / agent.host
    path.rmdir()
    os.rename(aside, path)


def watch_unreadable(observer: Allocation, agent: Allocation, clock: Clock) -> list[float]:
    """15 s of looks at an unreadable heartbeat while the agent beats each second; when it was
    called dead (none, if all is well)."""
    aside = unreadable(agent)
    dead_at = []
    began = clock.now
    while clock.now - began < UNREADABLE_S:
        clock.now += 0.5
        if clock.now % 1 == 0:
            agent.beat()
        if not observer.alive("n2") or observer.decider(Roster(HOSTS)) != "n1":
            dead_at.append(clock.now - began)
    readable_again(agent, aside)
    return dead_at


@pytest.mark.parametrize("linked", [True, False], ids=["with-its-link-up", "without-a-link"])
def test_a_heartbeat_unreadable_for_15_s_declares_nobody_dead(tmp_path: Path, linked: bool) -> None:
    observer, agent, clock = pair(tmp_path, linked=linked)
    assert observer.alive("n2")
    assert watch_unreadable(observer, agent, clock) == []
    # readable again: alive, and the window still works when it really stops beating
    agent.beat()
    clock.now += 0.5
    assert observer.alive("n2")
    if linked:
        agent.stop_beating()  # (its link closes: the first evidence)
        assert not observer.alive("n2")
    else:
        clock.now += DEAD_AFTER_S + 0.5
        assert not observer.alive("n2")
    observer.stop_beating()


def test_a_silent_agent_is_still_dead_once_reads_succeed_again(tmp_path: Path) -> None:
    """Unreadable time is no evidence either way: an agent that stopped beating before the outage
    is called dead by the window counted over the reads that succeeded, before and after it."""
    observer, agent, clock = pair(tmp_path, linked=False)
    assert observer.alive("n2")
    clock.now += DEAD_AFTER_S / 2
    assert observer.alive("n2")
    aside = unreadable(agent)
    clock.now += UNREADABLE_S
    assert observer.alive("n2")  # (as it stood at the last read)
    readable_again(agent, aside)
    clock.now += DEAD_AFTER_S / 2 - 0.5
    assert observer.alive("n2")
    clock.now += 1.0
    assert not observer.alive("n2")
