"""Why an attempt ended: one enum, used by every side (stop controller, relay, schedulers, outcome,
decision, ledger, status, accounting).

The value is what the run directory records (``"timeout"``, ``"crash"``, ...). Parsing an unknown
value is an error, never a guess: a cause that nobody defined cannot be retried or ended correctly.
Every run directory ever written uses only these values, so old runs read unchanged.

What a cause means for the run is decided in ``jobs.decision_rules``; what is fixed here is only its
vocabulary and which budget a continuation for it spends.
"""

from __future__ import annotations

from enum import Enum


class UnknownCause(ValueError):
    """A cause value that is not one of ``Cause``'s."""


class RecordedEnum(str, Enum):
    """An enum whose ``str()`` and f-strings give the recorded value, on every Python (3.11 changed
    what a ``str`` mix-in enum formats to)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Budget(RecordedEnum):
    """The retry budget a continuation spends, as recorded (``counts_as``): requeue
    (scheduler.max_requeues), crash (max_failure_retries), hang (max_hang_retries), node
    (preflight.max_node_excludes)."""

    REQUEUE = "requeue"
    CRASH = "crash"
    HANG = "hang"
    NODE = "node"

    @property
    def after_failure(self) -> bool:
        """A failure's budget, not one a stop the allocation's end asked for spends."""
        return self is not Budget.REQUEUE

    @classmethod
    def parse_optional(cls, value: object) -> Budget | None:
        """The budget recorded as ``value``; None when absent or one this version does not know (it
        cannot be counted against a budget nobody defined)."""
        try:
            return None if value is None or value == "" else cls(str(value))
        except ValueError:
            return None


class Cause(RecordedEnum):
    # The allocation ends or the user asks: every rank stops after the same step and saves.
    TIMEOUT = "timeout"
    PREEMPTION = "preemption"
    USER = "user"
    # The scheduler's cancellation (scancel, qdel, hpclaunch cancel): never continued.
    CANCELLED = "cancelled"
    # Failures. crash, filesystem, hang and node_failure are the machine's: retried within their
    # budgets. training and data are the run's own verdicts: the same code on the same data fails
    # again, so they are never retried.
    CRASH = "crash"
    FILESYSTEM = "filesystem"  # could not read or write the run's files now (EIO, ESTALE, ...)
    HANG = "hang"
    NODE_FAILURE = "node_failure"
    TRAINING = "training"
    DATA = "data"

    @classmethod
    def parse(cls, value: object) -> Cause:
        """The cause recorded as ``value``; an unknown value raises ``UnknownCause``."""
        if isinstance(value, Cause):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            known = ", ".join(c.value for c in cls)
            raise UnknownCause(f"unknown cause {value!r} (known: {known})") from None

    @classmethod
    def parse_optional(cls, value: object) -> Cause | None:
        """``parse`` for fields that may be absent (None or "")."""
        return None if value is None or value == "" else cls.parse(value)

    @property
    def is_stop(self) -> bool:
        """A stop every rank agreed on and saved for (the allocation ends, or the user asked)."""
        return self in STOP_CAUSES

    @property
    def is_own_failure(self) -> bool:
        """The run's own verdict: retrying would repeat it."""
        return self in (Cause.TRAINING, Cause.DATA)

    @property
    def budget(self) -> Budget | None:
        """The budget a continuation for this cause spends (``None``: it is never continued)."""
        return _BUDGETS.get(self)

    @property
    def words(self) -> str:
        """The cause in a user's words (status, report)."""
        return _WORDS.get(self, self.value)


STOP_CAUSES = (Cause.TIMEOUT, Cause.PREEMPTION, Cause.USER)

_BUDGETS = {
    Cause.TIMEOUT: Budget.REQUEUE,
    Cause.PREEMPTION: Budget.REQUEUE,
    Cause.USER: Budget.REQUEUE,
    Cause.CRASH: Budget.CRASH,
    Cause.FILESYSTEM: Budget.CRASH,
    Cause.HANG: Budget.HANG,
    Cause.NODE_FAILURE: Budget.NODE,
}

_WORDS = {
    Cause.USER: "user stop",
    Cause.TIMEOUT: "time limit",
    Cause.NODE_FAILURE: "node failure",
    Cause.FILESYSTEM: "filesystem error",
    Cause.TRAINING: "training failure",
    Cause.DATA: "bad data",
}

# The stop causes as small integers, for the stop protocol's all_reduce(MAX): when several sources
# fire at once the larger wins (a preemption is more urgent than a time limit). A user's stop is
# the weakest as a *cause* of the save, but the user's *intent* (end the run) is not decided by
# this order: the user's request is kept apart (``rundir.control``) and wins in ``decide``.
STOP_CODES = {Cause.USER: 1, Cause.TIMEOUT: 2, Cause.PREEMPTION: 3}
STOP_BY_CODE = {code: cause for cause, code in STOP_CODES.items()}
# The exit code of a process whose run stopped for a cause, resumable (``hpclaunch train``, and a
# script's ``hpclaunch.Stopped`` when it runs standalone): 3 the user, 4 the time limit, 5 preempted.
STOP_EXIT_CODES = {Cause.USER: 3, Cause.CANCELLED: 3, Cause.TIMEOUT: 4, Cause.PREEMPTION: 5}
