"""What a rank has before its training objects exist: its site (run directory, config, attempt,
clock), its start-up clock, its progress reporter (the node agent's watchdog reads it from the
first second: a script's imports count against the launch window, not as a hang) and its stop
controller (signal handlers that only set a flag, installed before anything slow).

A rank begins its session as early as it can: the rank host's script runner before the user's
script runs, the MMDiT trainer first thing. ``attach`` takes the session begun in this process, or
begins one itself (a standalone script). The session learns its ranks' group when the script has
joined one (``join``): the stop agreement needs it, the signal handlers do not.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..rundir import Ledger
from .progress import Progress, register_stack_dump
from .site import RankSite
from .startup import StartupClock
from .stop import StopController, StopGroup

__all__ = ["RankSession", "begin", "current", "end"]

_current: RankSession | None = None


@dataclass
class RankSession:
    site: RankSite
    rank: int
    startup: StartupClock
    progress: Progress
    stop: StopController
    ledger: Ledger | None  # rank 0's, under hpclaunch; None on the other ranks and standalone

    def join(self, rank: int, world_size: int, group: object) -> None:
        """The ranks this one stops with, once the script has joined its process group."""
        self.rank = rank
        self.stop.join(StopGroup(rank, world_size, group))
        if rank == 0 and self.site.managed and self.ledger is None:
            self.ledger = Ledger(self.site.paths, role="trainer", attempt=self.site.attempt)
        elif rank != 0:
            self.ledger = None

    def close(self) -> None:
        self.progress.close()
        self.stop.restore_signal_handlers()


def begin(
    site: RankSite, *, startup: StartupClock | None = None, watch: bool = True, dump_stacks: bool = True
) -> RankSession:
    """Begin this process's session: progress from now on, stop signals only set a flag.
    ``dump_stacks``: register the watchdog's stack dump (a caller that did so already says False)."""
    global _current
    rank = int(os.environ.get("RANK", 0))
    startup = startup or StartupClock.since_process_start()
    if site.managed and dump_stacks:
        register_stack_dump(site.cfg, site.paths, site.attempt, rank)  # start-up hangs have stacks too
    progress = Progress.for_rank(
        site.cfg, site.paths, site.attempt, rank, device_type="cpu", enabled=watch and site.managed
    ).start()
    stop = StopController(paths=site.paths, attempt=site.attempt if site.managed else None, clock=site.clock)
    stop.install_signal_handlers()
    ledger = Ledger(site.paths, role="trainer", attempt=site.attempt) if site.managed and rank == 0 else None
    _current = RankSession(site, rank, startup, progress, stop, ledger)
    return _current


def current() -> RankSession | None:
    return _current


def end() -> None:
    """The session is over (the rank's program has returned): its threads and handlers go."""
    global _current
    if _current is not None:
        _current.close()
        _current = None
