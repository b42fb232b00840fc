"""What the decider knows when an attempt is over (or did not start): the facts ``decide`` reads.

After the node checks: which nodes failed them, whether the data did, the user's stop. After an
attempt: the trainer's outcome (read again through a shared filesystem's hiccups), this node's
return code, a cancel, the user's stop, a hang (the watchdog's verdict, the smoke test's, or nodes
that never reported), the nodes that died, the node a crash is pinned on (``attribution``), the
newest checkpoint, the live spares, and whether the allocation can carry another attempt. Reading
them appends what the ledger must keep (a hang found here) and takes the user's stop request.
"""

from __future__ import annotations

import time

from ..fsutil import retry_transient
from ..rundir import HANG, JobPlan
from ..rundir.control import take_user_stop
from ..rundir.events import Cancelled, Event, Started, of_kind
from ..rundir.outcome import AttemptOutcome, attempt_outcome
from ..rundir.paths import newest_checkpoint_step
from .allocation import REPORT_GRACE_S, Roster, node_ranks
from .attribution import Suspicion, suspect
from .decision_rules import Facts
from .node_checks import Verdicts
from .node_run import NodeRun
from .stop_relay import StopRelay
from .watchdog import Verdict, startup_hang


def started_at(events: list[Event], attempt: str) -> float:
    """When ``attempt`` started (its ``started`` event), 0 when the ledger has none."""
    for e in of_kind(events, Started):
        if e.attempt == attempt:
            return float(e.ts or 0)
    return 0.0


def in_place_ok(plan: JobPlan, *, stopping: bool, end_time: float | None, now: float) -> bool:
    """The allocation can carry another attempt: no stop under way (``stopping``), and time for a
    start-up and a stop save before the end (else the next attempt goes through the scheduler)."""
    if not plan.restart_in_place or stopping:
        return False
    if end_time is None:
        return True
    return end_time - now > max(60.0, 2 * plan.planned_stop_lead_s)


def after_checks(node: NodeRun, verdicts: Verdicts) -> Facts:
    """A node failed its checks (or the data did): the facts instead of an attempt's."""
    user = take_user_stop(node.paths, node.attempt)
    return Facts(
        outcome=None,
        failed_nodes=tuple(verdicts.failed_nodes),
        node_problems=verdicts.failed_nodes,
        data_error=verdicts.data_error,
        user_stop=user is not None,
        continue_requested=user is not None and user.continue_,
    )


def after_attempt(
    node: NodeRun,
    relay: StopRelay,
    returncode: int,
    roster: Roster,
    *,
    dead: tuple[str, ...] = (),
    stuck: tuple[str, ...] = (),
    hang: Verdict | None = None,
) -> tuple[Facts, list[Event]]:
    """The facts of this attempt, from this node's ``returncode``, the training nodes that did not
    report (``dead``, ``stuck``) and the watchdog's ``hang`` verdict; and the ledger's events they
    were read from (the run's history, for ``decide``)."""
    attempt, ledger = node.attempt, node.ledger
    events = ledger.events()
    cancelled = relay.cancelled or any(
        (e.ts or 0) >= started_at(events, attempt) for e in of_kind(events, Cancelled)
    )
    outcome, read_error = read_outcome(node)
    if hang is None:  # the smoke test may have named ranks that never reached it
        hang = startup_hang(node.paths, attempt, outcome, window_s=node.plan.agent.smoke_timeout_s)
        if hang is not None:
            ledger.append(HANG, **hang.ledger_fields())
    if hang is None and stuck:
        hang = Verdict.stuck(attempt, stuck, REPORT_GRACE_S)
        ledger.append(HANG, **hang.ledger_fields())
    blamed = crash_suspect(node, roster) if outcome is None or outcome.status == "failed" else None
    newest = newest_checkpoint_step(node.paths)
    # Taken now (atomically): a request written after this moment is the next attempt's.
    user = take_user_stop(node.paths, attempt)
    facts = Facts(
        outcome=outcome,
        returncode=returncode,
        cancelled=cancelled,
        user_stop=user is not None,
        continue_requested=user is not None and user.continue_,
        hang=hang.reason if hang is not None else None,
        hang_node=hang.culprit_node if hang is not None else None,
        interrupted=relay.interrupted,
        read_error=read_error,
        dead_nodes=dead,
        suspect=blamed.node if blamed is not None else None,
        suspect_evidence=blamed.evidence if blamed is not None else "",
        suspect_certain=blamed is not None and blamed.certain,
        newest_checkpoint=newest,
        spares=tuple(h for h in roster.spares if node.alloc.alive(h)),
        in_place_ok=in_place_ok(
            node.plan,
            stopping=relay.stop_cause is not None or relay.cancelled,
            end_time=node.ctx.end_time,
            now=time.time(),
        ),
    )
    return facts, events


def crash_suspect(node: NodeRun, roster: Roster) -> Suspicion | None:
    """The node this attempt's crash is pinned on, if the evidence names one (``attribution``)."""
    expect = node_ranks(node.ctx.hosts, roster.training)
    reports = node.alloc.reports(node.attempt, expect)
    logs = {h: node.paths.node_log(node.attempt, r) for r, h in expect.items()}
    return suspect(reports, logs)


def read_outcome(node: NodeRun) -> tuple[AttemptOutcome | None, str | None]:
    """The trainer's outcome, read again while the filesystem says "not now" (EIO, ESTALE): a
    shared filesystem's hiccup must not make a finished run look like a crash."""
    try:
        return retry_transient(lambda: attempt_outcome(node.paths, node.attempt)), None
    except OSError as e:
        return None, f"{node.paths.outcome_file(node.attempt)}: {e.strerror or e}"
