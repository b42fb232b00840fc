"""The ``scheduler`` check (login node): the batch system is there and can ever run this job.

SLURM: ``sbatch``/``squeue``/``sinfo`` installed; one ``sinfo -N`` call in an explicit ``-o`` format
(one line per node and partition) tells whether the partition exists, its MaxTime, and how many of
its nodes have the GPUs (gres), the features (a plain ``constraint``) and are not excluded. A job
that asks for more than a partition has would pend forever; more time than MaxTime is refused
(EnforcePartLimits) or pends forever.
PBS Pro / OpenPBS (``qstat -F json``): the queue (or the server's default) exists, is enabled and
started, its ``resources_max``/``resources_min.walltime`` allow the time limit, its ``kill_delay``
leaves time for a stop save, how a preemption comes back (``preempt_order``), and whether enough
usable nodes (``pbsnodes -a -F json``) can take one ``select`` chunk each (``ngpus`` above every
node's own is a failure here, not a job that queues forever). Torque and Slurm's Torque emulation
(no JSON): the queue exists and its ``resources_max.walltime`` allows the time limit, when
``qstat -Q`` answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from ..config import format_hms
from ..errors import did_you_mean
from ..rundir.clock import whole_minutes
from ..schedulers import pbs_json
from .check_context import CheckContext, Findings, Outcome, skip
from .sizes import estimated_save_s, run_checkpoint_bytes

T = TypeVar("T")

SINFO_FORMAT = "%P|%a|%l|%N|%T|%G|%f|%c"
_FLAGS = "*~#!%$@^-+"
# Base node states that can run a job now or soon (power-saved nodes are woken up).
_USABLE = {"idle", "mixed", "allocated", "completing", "planned", "powered_down", "powering_up", "cloud"}


@dataclass
class SlurmNode:
    name: str
    state: str
    gpus: int
    features: frozenset[str]
    cpus: int | None = None  # None: not said (an older recording without %c)

    @property
    def usable(self) -> bool:
        return self.state.lower().rstrip(_FLAGS).split("+")[0] in _USABLE


@dataclass
class SlurmPartition:
    name: str
    default: bool
    avail: str
    max_time_s: int | None  # None = no limit
    nodes: list[SlurmNode] = field(default_factory=list)


def parse_slurm_time(text: str) -> int | None:
    """``sinfo %l``: infinite/UNLIMITED -> None; ``[D-]H:MM:SS``, ``M:SS``, ``D-H``, ``D-H:MM``, ``M``."""
    t = text.strip()
    if t.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
        parts = [int(x) for x in t.split(":")]
        h, m, s = [*parts, 0, 0, 0][:3]
        return ((days * 24 + h) * 60 + m) * 60 + s
    parts = [int(x) for x in t.split(":")]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    h, m, s = parts[:3]
    return (h * 60 + m) * 60 + s


def gres_gpus(gres: str) -> int:
    """GPUs in a gres string: ``gpu:8``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,shard:8``, ``(null)``."""
    return sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)", gres.strip()))


def parse_sinfo(text: str) -> dict[str, SlurmPartition]:
    """Output of ``sinfo -h -a -N -o SINFO_FORMAT`` -> partitions by name (nodes deduplicated)."""
    parts: dict[str, SlurmPartition] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) < 6:
            raise ValueError(f"unexpected sinfo line {line!r}")
        pname, avail, limit, node, state, gres = (x.strip() for x in fields[:6])
        features = frozenset(
            x for x in (fields[6].strip().split(",") if len(fields) > 6 else []) if x and x != "(null)"
        )
        cpus = fields[7].strip() if len(fields) > 7 else ""
        default = pname.endswith("*")
        pname = pname.rstrip("*")
        p = parts.get(pname)
        if p is None:
            p = parts[pname] = SlurmPartition(pname, default, avail, parse_slurm_time(limit))
        if node not in (n.name for n in p.nodes):
            p.nodes.append(
                SlurmNode(node, state, gres_gpus(gres), features, int(cpus) if cpus.isdigit() else None)
            )
    return parts


def _plain_features(constraint: str | None) -> set[str] | None:
    """``a&b`` / ``a`` -> {a, b}; None when the expression is richer than we evaluate (| [ ] *)."""
    if not constraint:
        return set()
    if re.search(r"[|\[\]*()]", constraint):
        return None
    return {c.strip() for c in constraint.split("&") if c.strip()}


def check_scheduler(ctx: CheckContext) -> Outcome:
    """The batch system's tools, the partition/queue, its time limit and nodes (sinfo / qstat -Q)."""
    kind = ctx.cfg.scheduler.kind
    if kind == "local":
        return skip("local scheduler: no batch system needed")
    if kind == "slurm":
        return _slurm(ctx)
    return _pbs(ctx)


def _slurm(ctx: CheckContext) -> Outcome:
    s = ctx.cfg.scheduler
    f = Findings()
    missing = [t for t in ("sbatch", "squeue", "sinfo") if ctx.which(t) is None]
    if missing:
        f.fail(
            f"{', '.join(missing)} not found on PATH", "run on a SLURM login node (or load the slurm module)"
        )
        return f.outcome()
    res = ctx.run(["sinfo", "-h", "-a", "-N", "-o", SINFO_FORMAT], 20)
    if res is None or not res.ok:
        f.fail(
            f"sinfo failed: {res.error_line() if res else 'not found'}", "is slurmctld reachable from here?"
        )
        return f.outcome()
    try:
        parts = parse_sinfo(res.stdout)
    except ValueError as e:
        f.fail(f"cannot read sinfo output ({e})")
        return f.outcome()
    if s.partition is None:
        default = next((p for p in parts.values() if p.default), None)
        if default is None:
            f.fail(
                f"no scheduler.partition given and the cluster has no default partition ({', '.join(parts) or 'none'})",
                "set scheduler.partition",
            )
            return f.outcome()
        part = default
    elif s.partition not in parts:
        f.fail(
            f"partition {s.partition!r} does not exist{did_you_mean(s.partition, parts)}"
            + f"; partitions: {', '.join(parts) or 'none'}",
            "set scheduler.partition to one of them (sinfo -s lists them)",
        )
        return f.outcome()
    else:
        part = parts[s.partition]
    label = f"partition {part.name}" + (" (default)" if s.partition is None else "")

    if part.avail.lower() != "up":
        f.warn(
            f"{label} is {part.avail}: jobs queue but do not start",
            "ask the admins or pick another partition",
        )
    asked = whole_minutes(s.time_limit_s) * 60  # SLURM counts whole minutes
    if part.max_time_s is not None and asked > part.max_time_s:
        f.fail(
            f"scheduler.time_limit {s.time_limit} exceeds {label}'s MaxTime {format_hms(part.max_time_s)}",
            "lower scheduler.time_limit (the run continues in the next attempt) or pick another partition",
        )

    nodes = [n for n in part.nodes if n.name not in set(s.exclude)]
    feats = _plain_features(s.constraint)
    if feats:
        nodes = [n for n in nodes if feats <= n.features]
    if s.gpus_per_node:
        nodes = [n for n in nodes if n.gpus >= s.gpus_per_node]
    what = "node(s)" + (f" with >= {s.gpus_per_node} GPUs (gres)" if s.gpus_per_node else "")
    cpus = ctx.cfg.cpus_per_node  # (all: at least the ranks' need)
    few_cpus = [n for n in nodes if n.cpus is not None and n.cpus < cpus]
    if few_cpus:  # a job asking for more CPUs per node than a node has never runs there
        nodes = [n for n in nodes if n not in few_cpus]
        what += f" and >= {cpus} CPUs"
    what += f" and features {'&'.join(sorted(feats))}" if feats else ""
    what += f" outside exclude {','.join(s.exclude)}" if s.exclude else ""
    usable = [n for n in nodes if n.usable]
    if len(nodes) < s.nodes:
        f.fail(
            f"{label} has {len(nodes)} {what}; the run asks for {s.nodes}",
            "lower scheduler.nodes / gpus_per_node / cpus_per_node, or pick a partition with more nodes",
        )
    elif len(usable) < s.nodes:
        down = ", ".join(f"{n.name} {n.state}" for n in nodes if not n.usable)
        f.warn(
            f"{label}: only {len(usable)} of {len(nodes)} {what} are up now ({down}); the job waits",
            "sinfo -R shows why nodes are down",
        )
    limit = "no MaxTime" if part.max_time_s is None else f"MaxTime {format_hms(part.max_time_s)}"
    if feats is None:
        f.skip(f"constraint {s.constraint!r} not evaluated")
    f.ok(f"{label}: {len(usable)} {what} up, {limit}; run needs {s.nodes} for {s.time_limit}")
    return f.outcome()


def parse_qstat_queues(text: str) -> dict[str, dict[str, str]]:
    """``qstat -Q -f`` (``Queue: name`` blocks of ``key = value``) -> {queue: {key: value}}."""
    queues: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        m = re.match(r"^Queue:\s*(\S+)", line.strip())
        if m:
            current = queues.setdefault(m.group(1), {})
            continue
        if current is not None and "=" in line:
            key, _, value = line.partition("=")
            current[key.strip()] = value.strip()
    return queues


def parse_qstat_table(text: str) -> list[str]:
    """``qstat -Q`` table -> queue names (first column of the rows after the ``----`` line)."""
    names, seen_rule = [], False
    for line in text.splitlines():
        if line.startswith("---"):
            seen_rule = True
            continue
        if seen_rule and line.strip():
            names.append(line.split()[0])
    return names


def _pbs(ctx: CheckContext) -> Outcome:
    f = Findings()
    if ctx.which("qsub") is None:
        f.fail("qsub not found on PATH", "run on a PBS login node (or load the PBS module)")
        return f.outcome()
    res = ctx.run(["qstat", "-Q", "-f", "-F", "json"], 20)
    if res is not None and res.ok and res.stdout.lstrip().startswith("{"):
        try:
            return _pbs_pro(ctx, f, pbs_json.parse_queues(res.stdout))
        except ValueError:
            pass
    return _pbs_text(ctx, f)


def _pbs_text(ctx: CheckContext, f: Findings) -> Outcome:
    """Torque and Slurm's Torque emulation: no JSON; queue names and walltime from ``qstat -Q``."""
    s = ctx.cfg.scheduler
    queues: dict[str, dict[str, str]] = {}
    res = ctx.run(["qstat", "-Q", "-f"], 20)
    if res is not None and res.ok:
        queues = parse_qstat_queues(res.stdout)
    if not queues:
        res = ctx.run(["qstat", "-Q"], 20)
        if res is not None and res.ok:
            queues = {q: {} for q in parse_qstat_table(res.stdout)}
    if not queues:
        why = "qstat not found" if res is None else f"qstat -Q: {res.error_line()}"
        f.ok("qsub found")
        f.skip(f"queues not checked ({why})")
        return f.outcome()
    if s.partition is None:
        f.ok(f"qsub found; default queue (queues: {', '.join(queues)})")
        return f.outcome()
    if s.partition not in queues:
        _no_such_queue(f, s.partition, queues)
        return f.outcome()
    wmax = queues[s.partition].get("resources_max.walltime")
    limit = parse_slurm_time(wmax) if wmax else None
    if limit is not None and s.time_limit_s > limit:
        _walltime_too_long(f, s.time_limit, s.partition, wmax or "")
    f.ok(f"queue {s.partition}" + (f", max walltime {wmax}" if wmax else ", no max walltime"))
    return f.outcome()


def _no_such_queue(f: Findings, name: str, queues: Iterable[str]) -> None:
    names = list(queues)
    f.fail(
        f"queue {name!r} does not exist{did_you_mean(name, names)}; queues: {', '.join(names)}",
        "set scheduler.partition to one of them (qstat -Q lists them)",
    )


def _walltime_too_long(f: Findings, time_limit: str, queue: str, wmax: str) -> None:
    f.fail(
        f"scheduler.time_limit {time_limit} exceeds queue {queue}'s resources_max.walltime {wmax}",
        "lower scheduler.time_limit (the run continues in the next attempt) or pick another queue",
    )


def _pbs_pro(ctx: CheckContext, f: Findings, queues: dict[str, pbs_json.PbsQueue]) -> Outcome:
    """PBS Pro / OpenPBS, from the server's own JSON: the queue, its walltime limits and kill_delay,
    how preemption comes back, and whether any node can take the job's ``select`` chunks."""
    s = ctx.cfg.scheduler
    server = _json(ctx, ["qstat", "-B", "-f", "-F", "json"], pbs_json.parse_server) or {}
    version = server.get("pbs_version", "")
    name = s.partition or server.get("default_queue")
    if not name:
        f.fail(
            f"no scheduler.partition given and the server has no default_queue ({', '.join(queues)})",
            "set scheduler.partition",
        )
        return f.outcome()
    if name not in queues:
        _no_such_queue(f, name, queues)
        return f.outcome()
    q = queues[name]
    label = f"queue {name}" + (" (default)" if s.partition is None else "")
    if q.queue_type.lower() != "execution":
        f.warn(f"{label} is a {q.queue_type.lower()} queue: jobs are routed on to other queues")
    if not q.enabled:
        f.fail(f"{label} is disabled: qsub refuses jobs there", "pick another queue (qstat -Q)")
    elif not q.started:
        f.warn(f"{label} is stopped: jobs queue but do not start", "ask the admins or pick another queue")
    if q.max_walltime_s is not None and s.time_limit_s > q.max_walltime_s:
        f.fail(
            f"scheduler.time_limit {s.time_limit} exceeds {label}'s resources_max.walltime "
            f"{format_hms(q.max_walltime_s)}",
            "lower scheduler.time_limit (the run continues in the next attempt) or pick another queue",
        )
    if q.min_walltime_s is not None and s.time_limit_s < q.min_walltime_s:
        f.fail(
            f"scheduler.time_limit {s.time_limit} is below {label}'s resources_min.walltime "
            f"{format_hms(q.min_walltime_s)}",
            "raise scheduler.time_limit or pick another queue",
        )
    kill_delay = q.kill_delay_s if q.kill_delay_s is not None else pbs_json.DEFAULT_KILL_DELAY_S
    params, _ = ctx.parameters()
    save_s = estimated_save_s(run_checkpoint_bytes(ctx.cfg, params))
    if kill_delay < save_s:
        f.warn(
            f"{label}'s kill_delay {kill_delay} s is shorter than a checkpoint save (~{save_s:.0f} s "
            "estimated): a qdel, qrerun or a preemption kills the job before its stop save ends, and "
            "the run resumes from its last periodic checkpoint",
            "pick a queue with a longer kill_delay (qstat -Qf), or keep checkpoint.every_steps small",
        )
    chunk = select_chunk(ctx.cfg.cpus_per_node, s.gpus_per_node, s.mem_gb)
    select = f"select={s.nodes}:{chunk}:mpiprocs=1"
    _queue_totals(f, label, q, s.nodes, ctx.cfg.cpus_per_node, s.gpus_per_node)
    fit = _nodes_for(ctx, f, select)
    order = _preempt_order(ctx)
    if order and "R" not in order.upper():
        f.warn(
            f"the scheduler's preempt_order {order!r} never requeues (R): a preempted job is suspended, "
            "checkpointed by the site or deleted, and comes back only by `hpclaunch submit --resume`",
            "ask the admins whether preemption can requeue (preempt_order with R)",
        )
    wall = "no max walltime" if q.max_walltime_s is None else f"max walltime {format_hms(q.max_walltime_s)}"
    line = f"PBS {version}: {label}, {wall}, kill_delay {kill_delay} s"
    if fit is not None:
        line += f"; {fit} node(s) can take a chunk of {select}"
    line += "; reruns: the job is submitted rerunnable (-r y)"
    line += f", preempt_order {order}" if order else ""
    f.ok(line)
    return f.outcome()


def select_chunk(cpus: int, gpus: int, mem_gb: float | None) -> str:
    """One ``select`` chunk's resources, as the PBS Pro template writes them."""
    chunk = f"ncpus={cpus}" + (f":ngpus={gpus}" if gpus else "")
    if mem_gb:
        chunk += f":mem={int(mem_gb)}gb" if mem_gb == int(mem_gb) else f":mem={int(mem_gb * 1024)}mb"
    return chunk


def _queue_totals(f: Findings, label: str, q: pbs_json.PbsQueue, nodes: int, cpus: int, gpus: int) -> None:
    for res, want in (("ncpus", nodes * cpus), ("ngpus", nodes * gpus), ("nodect", nodes)):
        limit = q.resources_max.get(res)
        if limit is not None and limit.isdigit() and want > int(limit):
            f.fail(
                f"the job asks for {res} {want} in all; {label}'s resources_max.{res} is {limit}",
                "lower scheduler.nodes / gpus_per_node / cpus_per_node, or pick another queue",
            )


def _nodes_for(ctx: CheckContext, f: Findings, select: str) -> int | None:
    """How many usable nodes can take one chunk; fails when fewer than the job's node count."""
    s = ctx.cfg.scheduler
    nodes = _json(ctx, ["pbsnodes", "-a", "-F", "json"], pbs_json.parse_nodes)
    if not nodes:
        f.skip("nodes not checked (pbsnodes -a -F json did not answer)")
        return None
    want = {"ncpus": ctx.cfg.cpus_per_node, "ngpus": s.gpus_per_node}
    candidates = [n for n in nodes.values() if n.name not in set(s.exclude)]
    fits = [n for n in candidates if all(n.count(r) >= v for r, v in want.items())]
    usable = [n for n in fits if n.usable]
    if not fits:
        short = next(r for r, v in want.items() if all(n.count(r) < v for n in candidates))
        most = max(n.count(short) for n in candidates)
        owners = [n.name for n in candidates if n.count(short) == most]
        have = (
            f"{owners[0]}'s {most}"
            if len(owners) == 1
            else f"the most any node has ({most}: {', '.join(owners)})"
        )
        f.fail(
            f"no node can take {select}: {short} {want[short]} > {have}",
            "lower scheduler.gpus_per_node / cpus_per_node (pbsnodes -a lists what the nodes have)",
        )
    elif len(fits) < s.nodes:
        f.fail(
            f"{len(fits)} node(s) can take a chunk of {select}; the run asks for {s.nodes}"
            + (f" (outside exclude {','.join(s.exclude)})" if s.exclude else ""),
            "lower scheduler.nodes, or pick a queue whose nodes can take the job",
        )
    elif len(usable) < s.nodes:
        down = ", ".join(f"{n.name} {n.state}" for n in fits if not n.usable)
        f.warn(
            f"only {len(usable)} of the {len(fits)} node(s) that can take {select} are up now ({down}); "
            "the job waits",
            "pbsnodes -l lists why nodes are down or offline",
        )
    return len(fits)


def _preempt_order(ctx: CheckContext) -> str | None:
    """The scheduler's preempt_order (S suspend, C checkpoint, R requeue, D delete), when readable."""
    res = ctx.run(["qmgr", "-c", "list sched"], 20)
    if res is None or not res.ok:
        return None
    m = re.search(r"^\s*preempt_order\s*=\s*(.+?)\s*$", res.stdout, re.M)
    return m.group(1).strip('"') if m else None


def _json(ctx: CheckContext, argv: list[str], parse: Callable[[str], T]) -> T | None:
    res = ctx.run(argv, 20)
    if res is None or not res.ok:
        return None
    try:
        return parse(res.stdout)
    except ValueError:
        return None
