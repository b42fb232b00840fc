"""``decide`` and ``decide_start``: every lifecycle case is a row.

Each row: the facts node 0 gathered, the budgets spent so far, whether the scheduler can exclude
nodes -> the action, the cause kept for ``status``, and a phrase the one-line reason must hold.
"""

from __future__ import annotations

from typing import Any

import pytest

from hpclaunch.jobs.decision_rules import (
    Action,
    Budgets,
    Facts,
    History,
    decide,
    decide_start,
    decide_unended,
    unended_attempt,
)
from hpclaunch.rundir import AttemptOutcome
from hpclaunch.rundir.cause import Cause
from hpclaunch.rundir.events import Event, as_events, parse_event

pytestmark = pytest.mark.fast

BUDGETS = Budgets(max_requeues=3, max_failure_retries=1, max_node_excludes=2, max_hang_retries=3)


def stopped(cause: str, step: int = 40) -> AttemptOutcome:
    return AttemptOutcome("stopped", cause, step)


def failed(cause: str, error: str) -> AttemptOutcome:
    return AttemptOutcome("failed", cause, 17, error)


ROWS: list[tuple[str, Facts, History, bool, Action, str | None, str]] = [
    (
        "finished",
        Facts(AttemptOutcome("finished", None, 200)),
        History(),
        True,
        Action.FINISH,
        None,
        "finished at step 200",
    ),
    (
        "timeout",
        Facts(stopped("timeout")),
        History(),
        True,
        Action.CONTINUE,
        "timeout",
        "stopped after step 40",
    ),
    (
        "preemption",
        Facts(stopped("preemption")),
        History(requeues=2),
        True,
        Action.CONTINUE,
        "preemption",
        "preemption",
    ),
    (
        "timeout over budget",
        Facts(stopped("timeout")),
        History(requeues=3),
        True,
        Action.FAIL,
        "timeout",
        "3 requeues used of 3",
    ),
    (
        # Slurm requeues a preempted job itself; when the budget is spent the decision is still
        # "fail", and the attempt Slurm starts anyway is withdrawn by decide_start (below).
        "preemption over budget, scheduler requeues anyway",
        Facts(stopped("preemption")),
        History(requeues=3),
        True,
        Action.FAIL,
        "preemption",
        "3 requeues used of 3",
    ),
    ("user stop", Facts(stopped("user")), History(), True, Action.END, "user", "it can be resumed"),
    (
        "user stop with continue",
        Facts(stopped("user"), continue_requested=True),
        History(),
        True,
        Action.CONTINUE,
        "user",
        "(user)",
    ),
    (
        # A raw scancel after the warning signal: the scheduler says "cancelled", never a time limit.
        "scancel after the warning",
        Facts(stopped("timeout"), cancelled=True),
        History(),
        True,
        Action.END,
        "cancelled",
        "never continued",
    ),
    (
        "cancel before a save",
        Facts(None, returncode=1, cancelled=True),
        History(),
        True,
        Action.END,
        "cancelled",
        "cancelled",
    ),
    (
        # The scheduler's SIGKILL was seconds away and the stop save had not finished: node 0 ended
        # the attempt itself; it continues from the last checkpoint as the timeout it was.
        "stop cut short before the scheduler's kill",
        Facts(None, returncode=-9, interrupted=Cause.TIMEOUT),
        History(),
        True,
        Action.CONTINUE,
        "timeout",
        "before the attempt could save",
    ),
    (
        "preemption cut short, over budget",
        Facts(None, returncode=-9, interrupted=Cause.PREEMPTION),
        History(requeues=3),
        True,
        Action.FAIL,
        "preemption",
        "3 requeues used of 3",
    ),
    (
        "crash within budget",
        Facts(failed("crash", "RuntimeError: NCCL error")),
        History(),
        True,
        Action.CONTINUE,
        "crash",
        "NCCL error",
    ),
    (
        "crash, no outcome",
        Facts(None, returncode=-9),
        History(),
        True,
        Action.CONTINUE,
        "crash",
        "left no outcome",
    ),
    (
        "crash over budget",
        Facts(None, returncode=1),
        History(crash_retries=1),
        True,
        Action.FAIL,
        "crash",
        "1 failure retries used of 1",
    ),
    (
        "non-finite failure",
        Facts(failed("training", "5 consecutive non-finite steps")),
        History(),
        True,
        Action.FAIL,
        "training",
        "non-finite",
    ),
    (
        "data error from the trainer",
        Facts(failed("data", "shard_00003.npz: id 999 >= vocab")),
        History(),
        True,
        Action.FAIL,
        "data",
        "shard_00003",
    ),
    (
        # A corrupt shard fails the data check everywhere: a data error naming the file, never a
        # node failure (which would exclude a healthy node on SLURM).
        "data check failed on every node",
        Facts(None, data_error="tokens/shard_00001.npz: not a readable .npz archive"),
        History(),
        True,
        Action.FAIL,
        "data",
        "bad training data: tokens/shard_00001.npz",
    ),
    (
        "node check failed on the only node",
        Facts(None, failed_nodes=("n1",), node_problems={"n1": "failed check gpu: 7 of 8 GPUs"}),
        History(),
        True,
        Action.EXCLUDE,
        "node_failure",
        "continuing without n1",
    ),
    (
        # On a multi-node job a non-head node's failed check reaches node 0 through the start
        # barrier; node 0 decides, once: a new job without that node.
        "node check failed on a non-head node",
        Facts(None, failed_nodes=("n2",), node_problems={"n2": "failed check node: marked unhealthy"}),
        History(excluded=("n7",)),
        True,
        Action.EXCLUDE,
        "node_failure",
        "n2: failed check node",
    ),
    (
        "node failure over the exclusion budget",
        Facts(None, failed_nodes=("n2",)),
        History(node_excludes=2),
        True,
        Action.FAIL,
        "node_failure",
        "2 node exclusions used of 2",
    ),
    (
        # The watchdog stopped the workers: no outcome, a verdict naming one node. SLURM continues
        # from the last checkpoint without it, spending the hang budget, not the crash budget.
        "hang naming one node (SLURM)",
        Facts(None, returncode=1, hang="rank 1 on n1 hung in data at step 12", hang_node="n1"),
        History(crash_retries=1, excluded=("n7",)),
        True,
        Action.EXCLUDE,
        "hang",
        "continuing from the last checkpoint without n1",
    ),
    (
        "hang naming one node where the scheduler cannot exclude (PBS, local)",
        Facts(None, returncode=1, hang="rank 1 on pbsn1 hung in save at step 20", hang_node="pbsn1"),
        History(),
        False,
        Action.CONTINUE,
        "hang",
        "continuing from the last checkpoint",
    ),
    (
        "hang without a single culprit: never an exclusion",
        Facts(None, returncode=1, hang="every rank waits in all_reduce at step 7; no single culprit known"),
        History(),
        True,
        Action.CONTINUE,
        "hang",
        "no single culprit known",
    ),
    (
        "hang over its budget",
        Facts(None, returncode=1, hang="rank 0 on n1 hung in startup", hang_node="n1"),
        History(hang_retries=3),
        True,
        Action.FAIL,
        "hang",
        "3 hang retries used of 3",
    ),
    (
        # A hang verdict that came after rank 0 wrote "finished": the work is done.
        "finished, then a hang in the teardown",
        Facts(AttemptOutcome("finished", None, 200), hang="rank 1 hung in done"),
        History(),
        True,
        Action.FINISH,
        None,
        "finished at step 200",
    ),
    (
        # `hpclaunch stop` while a rank hung: nobody could save, but the user's wish still ends the run
        "a user stop during a hang ends the run",
        Facts(None, returncode=1, hang="rank 1 hung in data at step 3", hang_node="n1", user_stop=True),
        History(),
        True,
        Action.END,
        "user",
        "rank 1 hung in data at step 3; stopped by the user: it can be resumed from its last checkpoint",
    ),
    (
        # Issue 16: `hpclaunch stop` and the scheduler's warning in one attempt. The ranks saved for
        # the stronger cause (timeout); the user's request still ends the run: never requeued.
        "a user stop and a time-limit warning in the same attempt end the run",
        Facts(stopped("timeout"), user_stop=True),
        History(),
        True,
        Action.END,
        "user",
        "stopped by the user after step 40 (the attempt also heard: time limit)",
    ),
    (
        "... and with a preemption after it",
        Facts(stopped("preemption"), user_stop=True),
        History(),
        True,
        Action.END,
        "user",
        "stopped by the user after step 40",
    ),
    (
        "a user stop --continue and a warning: continued once, for the timeout",
        Facts(stopped("timeout"), user_stop=True, continue_requested=True),
        History(),
        True,
        Action.CONTINUE,
        "timeout",
        "stopped after step 40 (timeout)",
    ),
    (
        "a user stop that a crash beat to it still ends the run",
        Facts(failed("crash", "RuntimeError: gloo connection reset"), user_stop=True),
        History(),
        True,
        Action.END,
        "user",
        "gloo connection reset; stopped by the user",
    ),
    (
        "a user stop does not hide the run's own failure",
        Facts(failed("training", "5 consecutive non-finite steps"), user_stop=True),
        History(),
        True,
        Action.FAIL,
        "training",
        "non-finite",
    ),
    (
        "a user stop does not hide a finish",
        Facts(AttemptOutcome("finished", None, 200), user_stop=True),
        History(),
        True,
        Action.FINISH,
        None,
        "finished at step 200",
    ),
    (
        # Issue 16: the outcome file could not be read (EIO/ESTALE after retries): a filesystem
        # failure, retried like a crash; never "no outcome, so it crashed" silently.
        "the outcome cannot be read: a filesystem failure, retried",
        Facts(None, returncode=0, read_error="attempts/7.0.json: Input/output error"),
        History(),
        True,
        Action.CONTINUE,
        "filesystem",
        "could not be read: attempts/7.0.json",
    ),
    (
        "a filesystem failure spends the crash budget",
        Facts(failed("filesystem", "cannot read manifest.json now (Stale file handle)")),
        History(crash_retries=1),
        True,
        Action.FAIL,
        "filesystem",
        "1 failure retries used of 1",
    ),
    (
        "a bad batch named by one rank: the run's own data failure",
        Facts(failed("data", "tokens/s0.npz: id 999 at sample 3, position 1 is outside 0..255")),
        History(),
        True,
        Action.FAIL,
        "data",
        "id 999",
    ),
    (
        "a cancellation wins over a hang",
        Facts(None, returncode=1, cancelled=True, hang="rank 1 hung in data at step 3", hang_node="n1"),
        History(),
        True,
        Action.END,
        "cancelled",
        "never continued",
    ),
    (
        "the rescue: the scheduler ended the job at its time limit before anyone decided (TIMEOUT)",
        Facts(None, interrupted=Cause.TIMEOUT, ended_by="the scheduler ended job 21 (TIMEOUT)"),
        History(),
        True,
        Action.CONTINUE,
        "timeout",
        "came before the attempt could save",
    ),
    (
        "the rescue: the batch host's agent left on a filesystem error, its node did not die",
        Facts(None, read_error="ESTALE", ended_by="the agent on n1 left: filesystem error ESTALE"),
        History(),
        True,
        Action.CONTINUE,
        "filesystem",
        "the agent on n1 left: filesystem error ESTALE",
    ),
    (
        "the rescue: the scheduler ended the job OUT_OF_MEMORY (the run's memory, not a node)",
        Facts(None, ended_by="the scheduler ended job 21 OUT_OF_MEMORY"),
        History(),
        True,
        Action.CONTINUE,
        "crash",
        "OUT_OF_MEMORY",
    ),
    (
        "node failure where the scheduler cannot exclude (PBS, local)",
        Facts(None, failed_nodes=("pbsn1",)),
        History(),
        False,
        Action.FAIL,
        "node_failure",
        "cannot keep a continuation off a node",
    ),
]


@pytest.mark.parametrize(
    "facts,history,can_exclude,action,cause,phrase", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_decide(
    facts: Facts, history: History, can_exclude: bool, action: Action, cause: str | None, phrase: str
) -> None:
    d = decide(facts, history, BUDGETS, can_exclude_nodes=can_exclude)
    assert (d.action, d.cause) == (action, cause), d
    assert phrase in d.reason


def test_exclusion_keeps_earlier_exclusions() -> None:
    d = decide(Facts(None, failed_nodes=("n2",)), History(excluded=("n7",)), BUDGETS, can_exclude_nodes=True)
    assert d.exclude == ("n2", "n7") and d.counts_as == "node"


def test_continuations_say_which_budget_they_spend() -> None:
    assert (
        decide(Facts(stopped("timeout")), History(), BUDGETS, can_exclude_nodes=True).counts_as == "requeue"
    )
    assert decide(Facts(None), History(), BUDGETS, can_exclude_nodes=True).counts_as == "crash"
    hang = Facts(None, hang="rank 1 hung", hang_node="n1")
    assert decide(hang, History(), BUDGETS, can_exclude_nodes=True).counts_as == "hang"
    assert decide(hang, History(), BUDGETS, can_exclude_nodes=False).counts_as == "hang"


def ev(event: str, **fields: Any) -> Event:
    """A typed ledger event, as ``Ledger.events()`` reads it from its line on disk."""
    return parse_event({"event": event, **fields})


def test_history_counts_budgets_since_the_latest_fresh_submission() -> None:
    events = [
        ev("submitted", resume=False),
        ev("requeued", cause="timeout"),
        ev("requeued", cause="preemption"),
        ev("requeued", cause="crash"),
        ev("requeued", cause="hang"),
        ev("node_excluded", nodes=["n3"]),
        ev("requeued", cause="node_failure"),
        ev("failed", cause="timeout"),
    ]
    h = History.from_events(events)
    assert (h.requeues, h.crash_retries, h.node_excludes, h.excluded, h.ended) == (2, 1, 1, ("n3",), "failed")
    assert h.hang_retries == 1  # its own budget: neither a crash retry nor a requeue
    resumed = History.from_events([*events, ev("submitted", resume=True)])
    assert resumed.ended is None and resumed.requeues == 2  # --resume continues the run's budgets
    fresh = History.from_events([*events, ev("submitted", resume=False)])
    assert fresh == History()


@pytest.mark.parametrize("ended", ["finished", "failed", "cancelled", "ended", "held"])
def test_an_attempt_after_the_run_ended_is_withdrawn(ended: str) -> None:
    d = decide_start(History.from_events([ev("submitted"), ev(ended)]))
    assert d is not None and d.action is Action.WITHDRAW and ended in d.reason
    assert d.event == "held"


def test_an_attempt_of_a_live_run_may_start() -> None:
    assert decide_start(History.from_events([ev("submitted"), ev("requeued", cause="timeout")])) is None
    assert (
        decide_start(History.from_events([ev("submitted"), ev("failed"), ev("submitted", resume=True)]))
        is None
    )


def test_an_attempt_killed_before_its_decision_is_found_by_the_next_one() -> None:
    story = [
        ev("submitted", job_id="7"),
        ev("started", attempt="7.0", node=0),
        ev("started", attempt="7.0", node=1),
        ev("requeued", attempt="7.0", cause="timeout"),
        ev("started", attempt="7.1", node=0),
        ev("checkpoint_saved", attempt="7.1", step=40),  # ... and then SIGKILL: no decision
        ev("started", attempt="7.2", node=0),
    ]
    assert unended_attempt(story, "7.2") == "7.1"
    assert unended_attempt(story[:5], "7.1") is None  # every earlier attempt was decided
    assert unended_attempt([*story[:6], ev("held", attempt="7.1")], "7.2") is None
    assert unended_attempt([*story[:6], ev("refused", attempt="7.1")], "7.2") is None
    # a submission starts the story again: `submit --resume` after a lost run spends nothing
    assert unended_attempt([*story[:6], ev("submitted", resume=True), story[6]], "7.2") is None


@pytest.mark.parametrize(("used", "action"), [(0, Action.CONTINUE), (2, Action.CONTINUE), (3, Action.FAIL)])
def test_an_attempt_without_a_decision_spends_a_requeue_as_the_preemption_it_was(
    used: int, action: Action
) -> None:
    d = decide_unended("7.1", History(requeues=used), BUDGETS)
    assert (d.action, d.cause) == (action, Cause.PREEMPTION)
    assert "attempt 7.1 ended without a decision" in d.reason
    if action is Action.FAIL:
        assert d.event == "failed" and "3 requeues used of 3" in d.reason
        # ... and once that is written, the attempt the scheduler started is withdrawn
        assert decide_start(History.from_events([ev("submitted"), ev(d.event)])) is not None
    else:
        assert (d.event, d.counts_as, d.in_place) == ("requeued", "requeue", False)
        after = History.from_events([ev("submitted"), ev(d.event, cause=d.cause.value if d.cause else None)])
        assert after.requeues == 1 and decide_start(after) is None


# ---- where a continuation happens: in place (issue 17) or through the scheduler ----------------

IN_PLACE_ROWS: list[
    tuple[str, Facts, History, bool, Action, str | None, bool, tuple[tuple[str, str], ...], str]
] = [
    (
        "a crash, time left: restarted in place",
        Facts(failed("crash", "RuntimeError: gloo connection reset"), in_place_ok=True),
        History(),
        True,
        Action.CONTINUE,
        "crash",
        True,
        (),
        "restarting in place (1 of 1 failure retries)",
    ),
    (
        "a crash over its budget is not restarted anywhere",
        Facts(failed("crash", "RuntimeError: gloo connection reset"), in_place_ok=True),
        History(crash_retries=1),
        True,
        Action.FAIL,
        "crash",
        False,
        (),
        "1 failure retries used of 1",
    ),
    (
        "a crash near the allocation's end goes through the scheduler",
        Facts(failed("crash", "RuntimeError: boom"), in_place_ok=False),
        History(),
        True,
        Action.CONTINUE,
        "crash",
        False,
        (),
        "boom",
    ),
    (
        "an unreadable outcome: a filesystem failure restarted in place",
        Facts(None, read_error="attempts/7.0.json: Stale file handle", in_place_ok=True),
        History(),
        True,
        Action.CONTINUE,
        "filesystem",
        True,
        (),
        "restarting in place",
    ),
    (
        "a hang naming a node, a spare waiting: the spare takes its place",
        Facts(
            None,
            hang="rank 2 on n2 hung in data at step 25",
            hang_node="n2",
            spares=("n3",),
            in_place_ok=True,
        ),
        History(),
        True,
        Action.CONTINUE,
        "hang",
        True,
        (("n2", "n3"),),
        "n3 taking the place of n2",
    ),
    (
        "a hang naming a node, no spare: SLURM keeps the run off it in a new job",
        Facts(None, hang="rank 2 on n2 hung in data at step 25", hang_node="n2", in_place_ok=True),
        History(),
        True,
        Action.EXCLUDE,
        "hang",
        False,
        (),
        "without n2",
    ),
    (
        "a hang naming no node: restarted in place on the same nodes",
        Facts(
            None, hang="every rank waits in all_reduce at step 7; no single culprit known", in_place_ok=True
        ),
        History(),
        True,
        Action.CONTINUE,
        "hang",
        True,
        (),
        "restarting in place from the last checkpoint",
    ),
    (
        "a dead node, a spare waiting: replaced in place",
        Facts(
            failed("crash", "Connection closed by peer"), dead_nodes=("n2",), spares=("n3",), in_place_ok=True
        ),
        History(),
        True,
        Action.CONTINUE,
        "node_failure",
        True,
        (("n2", "n3"),),
        "n2: its agent and ranks are gone; restarting in place, n3 taking the place of n2",
    ),
    (
        "a dead node, no spare: a new job without it (SLURM)",
        Facts(failed("crash", "Connection closed by peer"), dead_nodes=("n2",), in_place_ok=True),
        History(),
        True,
        Action.EXCLUDE,
        "node_failure",
        False,
        (),
        "continuing without n2",
    ),
    (
        "two dead nodes, one spare: not enough to go on in place",
        Facts(None, dead_nodes=("n1", "n2"), spares=("n3",), in_place_ok=True),
        History(),
        True,
        Action.EXCLUDE,
        "node_failure",
        False,
        (),
        "continuing without n1, n2",
    ),
    (
        "a node that failed its check, a spare waiting: replaced in place",
        Facts(
            None,
            failed_nodes=("n1",),
            node_problems={"n1": "failed check gpu"},
            spares=("n3",),
            in_place_ok=True,
        ),
        History(),
        True,
        Action.CONTINUE,
        "node_failure",
        True,
        (("n1", "n3"),),
        "n3 taking the place of n1",
    ),
    (
        "replacements spend the node budget",
        Facts(None, dead_nodes=("n2",), spares=("n3",), in_place_ok=True),
        History(node_excludes=2),
        True,
        Action.FAIL,
        "node_failure",
        False,
        (),
        "2 node exclusions used of 2",
    ),
    (
        "a time limit is never continued in place: the allocation is ending",
        Facts(stopped("timeout"), in_place_ok=True),
        History(),
        True,
        Action.CONTINUE,
        "timeout",
        False,
        (),
        "stopped after step 40 (timeout)",
    ),
    (
        "a user stop still ends the run, a spare or not",
        Facts(None, hang="rank 1 hung", hang_node="n2", spares=("n3",), in_place_ok=True, user_stop=True),
        History(),
        True,
        Action.END,
        "user",
        False,
        (),
        "stopped by the user",
    ),
]


@pytest.mark.parametrize(
    "facts,history,can_exclude,action,cause,in_place,replace,phrase",
    [r[1:] for r in IN_PLACE_ROWS],
    ids=[r[0] for r in IN_PLACE_ROWS],
)
def test_where_a_continuation_happens(
    facts: Facts,
    history: History,
    can_exclude: bool,
    action: Action,
    cause: str | None,
    in_place: bool,
    replace: tuple[tuple[str, str], ...],
    phrase: str,
) -> None:
    d = decide(facts, history, BUDGETS, can_exclude_nodes=can_exclude)
    assert (d.action, d.cause, d.in_place, d.replace) == (action, cause, in_place, replace), d
    assert phrase in d.reason


def test_the_history_counts_in_place_restarts_and_replacements_in_their_budgets() -> None:
    events = [
        ev("submitted", resume=False),
        ev("requeued", cause="crash", in_place=True),
        ev("requeued", cause="hang", in_place=True),
        ev("node_replaced", nodes=["n2"], spare="n3"),
        ev("requeued", cause="node_failure", in_place=True),
    ]
    h = History.from_events(events)
    assert (h.crash_retries, h.hang_retries, h.node_excludes, h.excluded) == (1, 1, 1, ("n2",))


def test_budgets_are_an_enum_recorded_as_their_names_and_an_unknown_one_spends_nothing() -> None:
    """Issue 27: retry budgets were strings ("requeue", "crash", ...) compared by hand."""
    import json

    from hpclaunch.jobs.decision_rules import History
    from hpclaunch.rundir.cause import Budget

    d = decide(Facts(None), History(), BUDGETS, can_exclude_nodes=True)
    assert d.counts_as is Budget.CRASH and json.dumps({"counts_as": d.counts_as}) == '{"counts_as": "crash"}'
    assert {c.budget for c in Cause} == {*Budget, None}
    assert [b for b in Budget if not b.after_failure] == [Budget.REQUEUE]
    events = [
        {"event": "requeued", "cause": "crash", "counts_as": "crash"},
        {"event": "requeued", "cause": "crash", "counts_as": "a-budget-from-a-later-version"},
        {"event": "requeued", "cause": "timeout"},  # written before counts_as was recorded
        {"event": "requeued", "cause": "hang", "counts_as": "hang"},
    ]
    h = History.from_events(as_events(events))
    assert (h.requeues, h.crash_retries, h.hang_retries) == (1, 1, 1)
