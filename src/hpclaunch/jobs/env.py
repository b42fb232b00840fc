"""Scheduler environment -> one typed ``NodeContext``.

The only place that reads ``SLURM_*``, ``PBS_*`` and ``HPCLAUNCH_*`` job variables. Everything
else receives a NodeContext. Parsing is pure (an environ mapping in, a context out); the few
lookups that need the outside world (a node's address from ``scontrol``) live in ``resolve_*``
functions below and fail loudly instead of falling back to localhost.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import HpclaunchError

# Variables the hpclaunch launchers set themselves (local controller, PBS script, agent).
RUN_DIR_VAR = "HPCLAUNCH_RUN_DIR"
JOB_ID_VAR = "HPCLAUNCH_JOB_ID"
RESTART_VAR = "HPCLAUNCH_RESTART_COUNT"
END_TIME_VAR = "HPCLAUNCH_JOB_END_TIME"
START_TIME_VAR = "HPCLAUNCH_JOB_START_TIME"
NODE_RANK_VAR = "HPCLAUNCH_NODE_RANK"
ATTEMPT_VAR = "HPCLAUNCH_ATTEMPT"


class NodeContextError(HpclaunchError):
    """The scheduler environment does not say what this node is (never guessed)."""


@dataclass(frozen=True)
class NodeContext:
    scheduler: str  # local | slurm | pbs
    job_id: str  # the id to requeue/cancel (array task: "<array>_<task>" on SLURM)
    node_rank: int
    num_nodes: int
    hostname: str  # this node, as the scheduler names it
    hosts: tuple[str, ...]  # every node of the allocation, head first
    restart_count: int = 0
    end_time: float | None = None  # time.time() at which the scheduler ends this attempt
    array_task: int | None = None

    @property
    def head(self) -> str:
        return self.hosts[0]

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def attempt(self) -> str:
        """Unique per attempt of this run: job id + restart count."""
        return f"{self.job_id}.{self.restart_count}"


def detect_scheduler(environ: Mapping[str, str]) -> str:
    if "SLURM_JOB_ID" in environ:
        return "slurm"
    if "PBS_JOBID" in environ:
        return "pbs"
    return "local"


def node_context(
    environ: Mapping[str, str] | None = None,
    *,
    kind: str | None = None,
    time_limit_s: int | None = None,
    now: float | None = None,
) -> NodeContext:
    """The context of this node from its environment (``os.environ`` by default).

    ``kind``: the scheduler the plan was submitted to. Pass it: detection is ambiguous where one
    scheduler emulates another (Slurm's Torque wrappers set both SLURM_* and PBS_* variables).
    """
    env = os.environ if environ is None else environ
    now = time.time() if now is None else now
    kind = kind or detect_scheduler(env)
    if kind == "slurm":
        return _slurm(env, time_limit_s, now)
    if kind == "pbs":
        if "PBS_JOBID" not in env:
            raise NodeContextError("PBS_JOBID is not set", hint="is this running inside a PBS job?")
        return _pbs(env, time_limit_s, now)
    return _local(env, now)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise NodeContextError(f"{name} is not set", hint="is this running inside the job?")
        return default
    try:
        return int(value)
    except ValueError:
        raise NodeContextError(f"{name}={value!r} is not an integer") from None


def _end_time(env: Mapping[str, str], time_limit_s: int | None, now: float) -> float | None:
    if env.get(END_TIME_VAR):
        return float(env[END_TIME_VAR])
    if env.get("SLURM_JOB_END_TIME"):
        return float(env["SLURM_JOB_END_TIME"])
    if time_limit_s is None:
        return None
    start = float(env.get(START_TIME_VAR) or env.get("SLURM_JOB_START_TIME") or now)
    return start + time_limit_s


def _slurm(env: Mapping[str, str], time_limit_s: int | None, now: float) -> NodeContext:
    array_task = env.get("SLURM_ARRAY_TASK_ID")
    job_id = env["SLURM_JOB_ID"]
    if array_task and env.get("SLURM_ARRAY_JOB_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{array_task}"
    hosts = tuple(expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", "")))
    num_nodes = _int(env, "SLURM_JOB_NUM_NODES", len(hosts) or 1)
    hostname = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    if not hosts:
        hosts = (hostname,)
    if len(hosts) != num_nodes:
        raise NodeContextError(
            f"SLURM_JOB_NODELIST names {len(hosts)} nodes but SLURM_JOB_NUM_NODES={num_nodes}"
        )
    node_rank = _int(env, "SLURM_NODEID", 0 if num_nodes == 1 else None)
    return NodeContext(
        scheduler="slurm",
        job_id=job_id,
        node_rank=node_rank,
        num_nodes=num_nodes,
        hostname=hostname,
        hosts=hosts,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        end_time=_end_time(env, time_limit_s, now),
        array_task=int(array_task) if array_task else None,
    )


_MPI_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID", "MPI_RANK")


def _pbs(env: Mapping[str, str], time_limit_s: int | None, now: float) -> NodeContext:
    hosts = tuple(read_pbs_nodefile(env.get("PBS_NODEFILE")))
    hostname = socket.gethostname().split(".")[0]
    if not hosts:
        # Slurm's Torque emulation and some single-node sites set no PBS_NODEFILE: a one-node job
        # runs on this host. Several nodes without a node file cannot be placed: fail.
        hosts = (hostname,)
    node_rank: int | None = None
    if env.get(NODE_RANK_VAR):
        node_rank = _int(env, NODE_RANK_VAR)
    else:
        for name in _MPI_RANK_VARS:
            if env.get(name):
                node_rank = _int(env, name)
                break
    if node_rank is None:
        short = [h.split(".")[0] for h in hosts]
        if hostname in short:
            node_rank = short.index(hostname)
        elif len(hosts) == 1:
            node_rank = 0
        else:
            raise NodeContextError(
                f"cannot tell which of the {len(hosts)} PBS nodes this is (host {hostname} is not in "
                f"PBS_NODEFILE and no MPI rank variable is set)",
                hint="launch one agent per node with mpiexec --ppn 1 or pbsdsh -u",
            )
    array = env.get("PBS_ARRAY_INDEX") or env.get("PBS_ARRAYID")
    return NodeContext(
        scheduler="pbs",
        job_id=env["PBS_JOBID"],
        node_rank=node_rank,
        num_nodes=len(hosts),
        hostname=hosts[node_rank] if node_rank < len(hosts) else hostname,
        hosts=hosts,
        restart_count=_int(env, RESTART_VAR, 0),
        end_time=_end_time(env, time_limit_s, now),
        array_task=int(array) if array else None,
    )


def _local(env: Mapping[str, str], now: float) -> NodeContext:
    hostname = socket.gethostname().split(".")[0]
    return NodeContext(
        scheduler="local",
        job_id=env.get(JOB_ID_VAR) or f"fg{os.getpid()}",
        node_rank=0,
        num_nodes=1,
        hostname=hostname,
        hosts=(hostname,),
        restart_count=_int(env, RESTART_VAR, 0),
        end_time=float(env[END_TIME_VAR]) if env.get(END_TIME_VAR) else None,
    )


def read_pbs_nodefile(path: str | None) -> list[str]:
    """Unique hosts of ``PBS_NODEFILE`` in first-seen order (PBS lists a host once per slot)."""
    if not path:
        return []
    try:
        lines = Path(path).read_text().split()
    except OSError as e:
        raise NodeContextError(f"cannot read PBS_NODEFILE {path} ({e.strerror})") from None
    return list(dict.fromkeys(line.strip() for line in lines if line.strip()))


_GROUP = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?")


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``n[1-3,7],gpu01`` -> ``[n1, n2, n3, n7, gpu01]`` (zero padding kept)."""
    out: list[str] = []
    pos = 0
    text = nodelist.strip()
    while pos < len(text):
        m = _GROUP.match(text, pos)
        if not m:
            raise NodeContextError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
        else:
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if not hi:
                    out.append(prefix + lo)
                    continue
                width = len(lo)
                out.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
        pos = m.end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
    return out


# ---- lookups that need the outside world ----------------------------------------------------


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def slurm_node_addr(node: str, *, timeout: float = 10.0) -> str | None:
    """``NodeAddr`` of a SLURM node from ``scontrol show node -o`` (None when scontrol is absent)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=timeout
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
    return m.group(1) if m else None


def resolve_address(host: str) -> str:
    """An IPv4/IPv6 address for ``host`` (an address is returned unchanged)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise NodeContextError(f"cannot resolve host {host!r} ({e.strerror})") from None


def node_address(ctx: NodeContext, host: str) -> str:
    """The address other nodes reach ``host`` at: SLURM's NodeAddr, else DNS."""
    if ctx.scheduler == "slurm":
        addr = slurm_node_addr(host)
        if addr:
            return resolve_address(addr)
    return resolve_address(host)


def rendezvous_address(ctx: NodeContext) -> str:
    """The head node's address; on a multi-node job a loopback answer is an error, never used."""
    addr = node_address(ctx, ctx.head)
    if ctx.num_nodes > 1 and is_loopback(addr):
        raise NodeContextError(
            f"the head node {ctx.head} resolves to the loopback address {addr}; the other "
            f"{ctx.num_nodes - 1} node(s) could not reach the rendezvous there",
            where=f"node {ctx.hostname}",
            hint="fix the node's address in DNS//etc/hosts (or SLURM NodeAddr)",
        )
    return addr


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` on this host (None when none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None
