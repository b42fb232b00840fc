"""The ``fds`` check: ``ulimit -n`` against the descriptors the job opens at its size.

What one process opens grows with the world size W (docs/design.md, "Descriptors"): every gloo
group is a full mesh, W-1 peer sockets plus a listening socket and gloo's event loop (W + 3,
measured), and the rendezvous host's rank host (its elastic launcher's c10d store) holds the
store's connection from every rank, every writer process and every agent. A limit below that fails far from here, as a gloo connect error at
start-up or a broken save hours in. The decider's agent holds a link to every other agent and
accepts one from each (``jobs.links``: two per node, spares included). Torch-free.

On a node the check raises the soft limit to the hard one itself where that suffices: the node
agent runs it, and the rank host and the ranks inherit the agent's limits. On the login node it says
whether the nodes will manage (SLURM also gives the job the submitting shell's soft limits).
"""

from __future__ import annotations

import resource

from ..config import RunConfig
from .check_context import CheckContext, Outcome
from .results import Status

# The interpreter, torch's libraries, CUDA's device files, logs, the data shards a loader holds: a
# rank's descriptors that do not grow with W (a CPU rank holds about 60, a GPU rank a few hundred).
BASE_FDS = 256
PER_GLOO_GROUP = 3  # beside the W-1 peer sockets: the listening socket, the event loop's epoll, an eventfd


def gloo_group_sizes(cfg: RunConfig) -> list[int]:
    """The size of every gloo group one training process joins (``trainer/setup/parallel.py``, ``build.py``)."""
    s, t = cfg.scheduler, cfg.train
    world = s.world_size
    # The host group (the default group on CPU, the gloo group beside NCCL) and the checkpointer's
    # own: background saves never share a collective order with the training loop's collectives.
    sizes = [world, world]
    shard = t.fsdp_shard_size
    if t.parallel == "fsdp" and s.gpus_per_node == 0 and shard is not None and shard < world:
        sizes += [world // shard, shard]  # HSDP's mesh: a replicate and a shard group, gloo on CPU
    return sizes


def needed_fds(cfg: RunConfig) -> int:
    """The most descriptors one process of the job opens: a rank, or the rendezvous host's rank host."""
    s = cfg.scheduler
    world = s.world_size
    rank = BASE_FDS + sum(n + PER_GLOO_GROUP for n in gloo_group_sizes(cfg) if n > 1)
    writers = world if cfg.checkpoint.async_save and cfg.checkpoint.writer == "process" else 0
    store_host = BASE_FDS + world + writers + s.nodes
    decider = BASE_FDS + 2 * (s.nodes + s.spare_nodes)  # (jobs.links: one out, one in, per agent)
    return max(rank, store_host, decider)


def _limits() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _raise_soft(to: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (to, hard))


def _text(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)


def check_fds(ctx: CheckContext) -> Outcome:
    """Compare ``ulimit -n`` (soft and hard) with the descriptors the job opens at its size."""
    need, world = needed_fds(ctx.cfg), ctx.cfg.scheduler.world_size
    soft, hard = _limits()
    have = f"ulimit -n {_text(soft)} (hard {_text(hard)})"
    wants = f"the job opens up to {need} descriptors in one process at {world} ranks"
    if soft == resource.RLIM_INFINITY or soft >= need:
        return Outcome(Status.PASS, f"{have}; {wants}")
    if hard != resource.RLIM_INFINITY and hard < need:
        return Outcome(
            Status.FAIL,
            f"{have} is below what {wants}",
            f"set a hard limit of at least {need} for the job's user (limits.conf nofile, or the "
            "slurmd/pbs_mom service's LimitNOFILE), or run on fewer ranks",
        )
    if not ctx.on_node:
        return Outcome(Status.PASS, f"{have}; {wants}: the node checks raise the soft limit to the hard one")
    target = hard if hard != resource.RLIM_INFINITY else need
    try:
        _raise_soft(target, hard)
    except (ValueError, OSError) as e:
        return Outcome(
            Status.FAIL,
            f"{have} is below what {wants}, and raising the soft limit to {target} failed ({e})",
            f"run `ulimit -n {need}` in the job script before hpclaunch starts, or ask the admins",
        )
    return Outcome(Status.PASS, f"raised the soft ulimit -n from {soft} to {_text(target)}: {wants}")
