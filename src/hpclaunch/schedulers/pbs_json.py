"""What PBS Pro / OpenPBS says about jobs, queues, the server and its nodes, in its JSON form
(``qstat -x -f -F json``, ``qstat -Q -f -F json``, ``qstat -B -f -F json``, ``pbsnodes -a -F json``).

Pure: text in, typed records out; the commands are run elsewhere. Job states are mapped without
loss: a finished job (``F``, or ``X`` for a sub-job) is told apart by its substate and exit status
(finished, failed, walltime, deleted), a held job (``H``) by why it is held (a dependency, or a
user/operator/system hold), a job being requeued by ``qrerun`` or a preemption (``R`` with
substate RERUN) from one that runs. Slurm's Torque emulation has no ``-F json``; callers fall back
to the text of ``qstat -f`` there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .protocol import JobState, SchedulerStatus

# Substates (OpenPBS src/include/job.h) that change what a state letter means.
SUBSTATE_DEPEND_HOLD = 22
SUBSTATE_RUNNING = 42
SUBSTATE_SUSPENDED = (43, 45)  # suspended by a signal / by the scheduler (preemption "S")
SUBSTATE_RERUN = (60, 61, 62, 63)  # qrerun, or a preemption that requeues (preempt_order "R")
SUBSTATE_TERMINATED = 91  # qdel
SUBSTATE_FINISHED = 92
SUBSTATE_FAILED = 93
SUBSTATE_MOVED = 94

# Exit_status < 0: PBS itself ended the job (JOB_EXEC_* in job.h). > 256: killed by signal N-256.
JOB_EXEC_KILL_WALLTIME = -29
EXEC_CODES = {
    -24: "exceeded its ncpus (burst)",
    -25: "exceeded its ncpus (sum)",
    -26: "exceeded its vmem",
    -27: "exceeded its mem",
    -28: "exceeded its cput",
    JOB_EXEC_KILL_WALLTIME: "exceeded its walltime",
}
HOLD_TYPES = {"u": "user", "o": "operator", "s": "system", "p": "bad password", "n": "none"}


@dataclass(frozen=True)
class PbsJob:
    job_id: str
    state: str  # the letter: Q H W T R E B S U F X M
    substate: int | None = None
    exit_status: int | None = None
    run_count: int = 0
    comment: str = ""
    hold_types: str = ""
    depend: str = ""
    queue: str = ""
    exec_hosts: tuple[str, ...] = ()
    array: bool = False
    array_id: str | None = None
    array_index: int | None = None
    rerunable: bool = True

    @classmethod
    def from_json(cls, job_id: str, a: dict[str, Any]) -> PbsJob:
        hosts = tuple(dict.fromkeys(h.split("/")[0] for h in str(a.get("exec_host") or "").split("+") if h))
        return cls(
            job_id=job_id,
            state=str(a.get("job_state", "")),
            substate=_int(a.get("substate")),
            exit_status=_int(a.get("Exit_status")),
            run_count=_int(a.get("run_count")) or 0,
            comment=str(a.get("comment") or ""),
            hold_types=str(a.get("Hold_Types") or ""),
            depend=str(a.get("depend") or ""),
            queue=str(a.get("queue") or ""),
            exec_hosts=hosts,
            array=str(a.get("array", "False")) == "True",
            array_id=a.get("array_id"),
            array_index=_int(a.get("array_index")),
            rerunable=str(a.get("Rerunable", "True")) == "True",
        )

    @property
    def rerun_in_progress(self) -> bool:
        """qrerun (or a preemption that requeues): PBS takes the nodes and will run the job again."""
        return self.state == "R" and self.substate in SUBSTATE_RERUN

    def status(self) -> SchedulerStatus:
        """Our state, PBS's own word for it (letter/substate) and why, never collapsed."""
        raw = self.state + (f"/{self.substate}" if self.substate is not None else "")
        s = self.state
        if s in ("F", "X"):
            state, why = self._final()
            return SchedulerStatus(state, raw, why)
        if s == "H":
            if self.substate == SUBSTATE_DEPEND_HOLD or (self.depend and "s" in self.hold_types):
                return SchedulerStatus(JobState.PENDING, raw, f"waiting for a dependency ({self.depend})")
            kinds = ", ".join(HOLD_TYPES.get(c, c) for c in self.hold_types if c != "n") or "a"
            return SchedulerStatus(JobState.HELD, raw, f"held ({kinds} hold; qrls releases it)")
        if s == "R" and self.substate in SUBSTATE_RERUN:
            return SchedulerStatus(JobState.REQUEUED, raw, "being requeued (qrerun or preemption)")
        if s in ("S", "U") or (s == "R" and self.substate in SUBSTATE_SUSPENDED):
            return SchedulerStatus(JobState.SUSPENDED, raw, "suspended")
        simple = {
            "Q": (JobState.PENDING, "queued"),
            "W": (JobState.PENDING, "waiting for its start time"),
            "T": (JobState.PENDING, "in transit"),
            "R": (JobState.RUNNING, ""),
            "E": (JobState.RUNNING, "exiting"),
            "B": (JobState.RUNNING, "array: sub-jobs running"),
            "M": (JobState.UNKNOWN, "moved to another server"),
        }
        state, reason = simple.get(s, (JobState.UNKNOWN, f"unknown PBS state {s!r}"))
        return SchedulerStatus(state, raw, reason)

    def _final(self) -> tuple[JobState, str]:
        code, sub = self.exit_status, self.substate
        if sub == SUBSTATE_MOVED:
            return JobState.UNKNOWN, "moved to another server"
        if sub == SUBSTATE_TERMINATED:
            ran = "" if code is None else f" after it ran (exit status {code})"
            return JobState.CANCELLED, f"deleted (qdel){ran}"
        if code == JOB_EXEC_KILL_WALLTIME:
            return JobState.TIMEOUT, "killed by PBS: it exceeded its walltime"
        if code is not None and code < 0:
            return JobState.FAILED, f"ended by PBS: {EXEC_CODES.get(code, f'Exit_status {code}')}"
        if code is not None and code > 256:
            return JobState.FAILED, f"killed by signal {code - 256}"
        if code == 0 or (code is None and sub == SUBSTATE_FINISHED):
            return JobState.COMPLETED, ""
        if code is None:
            return (JobState.FAILED, "failed") if sub == SUBSTATE_FAILED else (JobState.COMPLETED, "")
        return JobState.FAILED, f"exit status {code}"


@dataclass(frozen=True)
class PbsQueue:
    name: str
    queue_type: str = "Execution"
    enabled: bool = True
    started: bool = True
    kill_delay_s: int | None = None  # None: the server default (10 s)
    max_walltime_s: int | None = None
    min_walltime_s: int | None = None
    resources_max: dict[str, str] = field(default_factory=dict)
    resources_default: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PbsNode:
    name: str
    state: str  # free, job-busy, offline, down, ...
    host: str
    resources: dict[str, str] = field(default_factory=dict)  # resources_available
    comment: str = ""

    @property
    def usable(self) -> bool:
        """Can run a job now or soon (not down/offline/unknown/stale)."""
        bad = ("down", "offline", "unknown", "stale", "state-unknown", "unresolvable", "maintenance")
        return not any(b in self.state for b in bad)

    def count(self, resource: str) -> int:
        try:
            return int(self.resources.get(resource, 0))
        except (TypeError, ValueError):
            return 0


def _int(value: Any) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _load(text: str, key: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not PBS JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("not PBS JSON (no object)")
    section = data.get(key, {})
    return section if isinstance(section, dict) else {}


def parse_jobs(text: str) -> dict[str, PbsJob]:
    """``qstat [-x] [-t] -f -F json ...`` -> jobs by their full id (``12.pbshead``, ``7[1].pbshead``)."""
    return {jid: PbsJob.from_json(jid, attrs) for jid, attrs in _load(text, "Jobs").items()}


def find_job(jobs: dict[str, PbsJob], job_id: str) -> PbsJob | None:
    """The record of ``job_id`` whether or not it carries the server suffix (``12`` / ``12.pbshead``)."""
    if job_id in jobs:
        return jobs[job_id]
    short = job_id.split(".")[0]
    return next((j for jid, j in jobs.items() if jid.split(".")[0] == short), None)


def parse_duration(text: str | int | None) -> int | None:
    """PBS durations: ``[[HH:]MM:]SS`` or plain seconds -> seconds."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return text
    parts = str(text).strip().split(":")
    try:
        nums = [int(float(p)) for p in parts]
    except ValueError:
        return None
    total = 0
    for n in nums:
        total = total * 60 + n
    return total


def parse_queues(text: str) -> dict[str, PbsQueue]:
    """``qstat -Q -f -F json`` -> queues by name."""
    out: dict[str, PbsQueue] = {}
    for name, a in _load(text, "Queue").items():
        rmax = {k: str(v) for k, v in (a.get("resources_max") or {}).items()}
        rmin = {k: str(v) for k, v in (a.get("resources_min") or {}).items()}
        rdef = {k: str(v) for k, v in (a.get("resources_default") or {}).items()}
        out[name] = PbsQueue(
            name=name,
            queue_type=str(a.get("queue_type", "Execution")),
            enabled=str(a.get("enabled", "True")) == "True",
            started=str(a.get("started", "True")) == "True",
            kill_delay_s=_int(a.get("kill_delay")),
            max_walltime_s=parse_duration(rmax.get("walltime")),
            min_walltime_s=parse_duration(rmin.get("walltime")),
            resources_max=rmax,
            resources_default=rdef,
        )
    return out


def parse_server(text: str) -> dict[str, Any]:
    """``qstat -B -f -F json`` -> the (first) server's attributes."""
    servers = _load(text, "Server")
    return next(iter(servers.values()), {}) if servers else {}


def parse_nodes(text: str) -> dict[str, PbsNode]:
    """``pbsnodes -a -F json`` -> nodes (vnodes) by name."""
    out: dict[str, PbsNode] = {}
    for name, a in _load(text, "nodes").items():
        res = {k: str(v) for k, v in (a.get("resources_available") or {}).items()}
        out[name] = PbsNode(
            name=name,
            state=str(a.get("state", "")),
            host=res.get("host", name),
            resources=res,
            comment=str(a.get("comment") or ""),
        )
    return out


# Server default between SIGTERM and SIGKILL when a queue sets no kill_delay (pbs_queue_attributes).
DEFAULT_KILL_DELAY_S = 10
