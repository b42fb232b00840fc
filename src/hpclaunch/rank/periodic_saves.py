"""When this rank saves periodically, and what it measures to decide (``checkpoint.save_interval``).

The training loop tells it every step's time and whether a background save was in flight, asks it
whether the step just done is a save step, and tells it when it started one. After a save settles
on every rank (and at the calibration step of an attempt) rank 0 decides the next save step and
every rank adopts it (a broadcast on the host group); rank 0 appends ``checkpoint_interval`` to the
ledger (the interval, the measured save cost and step time, the MTBF, the expected loss per
failure), which ``hpclaunch status`` shows. A fixed ``every_steps`` needs no broadcast: every rank
knows it; its figures are still recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..rundir import Ledger, read_events
from ..rundir.kinds import CHECKPOINT_INTERVAL
from .checkpoint.save_interval import SaveSchedule, ledger_failures, policy_from_config
from .dist import DistContext, broadcast_json
from .site import RankSite

if TYPE_CHECKING:
    from .checkpoint import Checkpointer


class PeriodicSaves:
    def __init__(
        self, site: RankSite, ctx: DistContext, ledger: Ledger | None, *, start_step: int, last_step: int
    ) -> None:
        c = site.cfg.checkpoint
        failures, trained_s = 0, 0.0
        if ledger is not None and c.every_steps == "auto":  # rank 0: the failures this run has seen
            failures, trained_s = ledger_failures(
                read_events(site.paths).events, current_attempt=site.attempt
            )
        policy = policy_from_config(
            c.every_steps, c.every_minutes, c.mtbf_hours, site.cfg.scheduler.nodes,
            failures=failures, trained_s=trained_s, last_step=last_step,
        )  # fmt: skip
        self.schedule = SaveSchedule(policy, start_step=start_step)
        self.ctx = ctx
        self.ledger = ledger
        self._settled_seen = 0

    def observe(self, step_s: float, ckpt: Checkpointer | None) -> None:
        """The step just done took ``step_s``; was a background save in flight beside it?"""
        self.schedule.observe(step_s, saving=ckpt is not None and ckpt.pending)

    def due(self, step: int) -> bool:
        return self.schedule.due(step)

    def started(self, ckpt: Checkpointer | None, step: int) -> None:
        """A periodic ``save()`` returned: measure it (skipped when its step was published already)."""
        if ckpt is None:
            return
        sched = self.schedule
        if ckpt.settled_saves != self._settled_seen:  # the previous one settled inside this save()
            self._settled_seen = ckpt.settled_saves
            sched.save_settled()
            if sched.policy.mode == "steps":
                self._agree(step)  # only recorded: every rank knows a fixed interval
        if not ckpt.last_save_written:  # its step was published already: decide from what is known
            if sched.policy.mode != "steps":
                self._agree(step)
            return
        sched.save_started(step, ckpt.last_stall_seconds or 0.0)
        if not ckpt.pending:  # written blocking (checkpoint.async_save: false): its cost is known now
            self.schedule.save_settled()
            self._settled_seen = ckpt.settled_saves
            self._agree(step)

    def after_step(self, ckpt: Checkpointer | None, step: int) -> None:
        """After the loop polled the background save: decide when one has settled everywhere, or at
        the attempt's calibration step (every rank calls this at the same steps)."""
        if ckpt is None:
            return
        sched = self.schedule
        if ckpt.settled_saves != self._settled_seen:
            self._settled_seen = ckpt.settled_saves
            sched.save_settled()
            self._agree(step)
        elif sched.policy.mode != "steps" and sched.next_step is None and sched.calibrating(step):
            self._agree(step)

    def _agree(self, step: int) -> None:
        main = self.ctx.is_main
        decision: Mapping[str, object] = self.schedule.propose(step) if main else {}
        if self.schedule.policy.mode != "steps":
            decision = broadcast_json(decision, self.ctx.host_group(), is_source=main)
            self.schedule.adopt(decision)
        if self.ledger is not None:
            self.ledger.append(CHECKPOINT_INTERVAL, **decision)
