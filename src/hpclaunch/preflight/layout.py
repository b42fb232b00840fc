"""The ``config`` check: the run's layout and its time budget, as far as they can be known before it runs.

It also reports the NCCL variables' warnings (deprecated aliases, names newer than our table): the
config loader refuses only what is certainly wrong, so doubtful settings surface here.

What is exact: ranks, per-rank batch and accumulation (the config loader already refuses a global
batch that does not divide). What is estimated, and said so: the checkpoint size (from the
parameter count, exact when the probe built the model) and its save time (at an assumed
200 MB/s), the startup time (60 s), the step time (unknown, unless ``testing.step_sleep_s`` gives a
lower bound). Doubts are warnings, never failures: they cannot be proven before the run.

Host memory per node: a background save stages a copy of each rank's state in host memory (pinned
on GPUs; on CPU ranks beside the training state itself), so a node needs ranks x (staging copy +
training state on CPU + an assumed runtime) (``sizes.estimate_host_memory``), against
``scheduler.mem_gb``, else this machine's memory where it is the node (the local scheduler, or on a
node); it fails the check when it does not fit, naming both figures. With the memory tier, its
snapshots (own, the ward's copies, one being written) and its staging or restore buffer count there
too, and where this machine is the node the snapshots are sized against the tmpfs's free space
(a warning: a tier without room steps aside).

Memory per GPU (GPU runs): parameters, gradients, optimizer state, EMA and activations under the
chosen sharding (``sizes.estimate_memory``), against ``train.memory_budget_gb`` or the smallest GPU
the probe sees. An estimate that does not fit fails the check: the run would die of CUDA OOM
after its queue wait. With no budget to compare against (a login node without GPUs and no
``train.memory_budget_gb``) the figure is reported, not judged; the node checks see the GPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import RunConfig
from ..nccl import validate_nccl_env
from ..rundir.clock import stop_lead_s
from ..rundir.shm import base_of
from .check_context import CheckContext, Findings, Outcome
from .sizes import (
    ASSUMED_STARTUP_S,
    ASSUMED_WRITE_BPS,
    estimate_host_memory,
    estimate_memory,
    estimated_save_s,
    human_bytes,
    largest_micro_batch,
    planned_save_s,
    run_checkpoint_bytes,
    snapshot_tmpfs_bytes_per_rank,
)

MIN_TRAIN_S = 60  # an attempt that trains less than this per time limit mostly restarts
MICRO_BATCH_LIMIT = 1024  # the largest micro-batch the memory check looks for


def check_config(ctx: CheckContext) -> Outcome:
    """Layout (nodes x ranks, samples/rank), stop lead vs estimated save time, walltime vs intervals."""
    cfg = ctx.cfg
    if cfg.is_script:
        return _check_script_layout(ctx)
    s, t, c = cfg.scheduler, cfg.train, cfg.checkpoint
    f = Findings()
    layout = (
        f"{s.nodes} node(s) x {s.nprocs} rank(s) = {s.world_size} ({cfg.backend}), "
        f"{cfg.per_rank_batch} samples/rank"
    )
    if cfg.grad_accum > 1:
        layout += f" ({cfg.micro_batch} x {cfg.grad_accum} accumulation steps)"
    if s.kind != "local":
        cpus = "whole nodes" if s.cpus_per_node == "all" else f"{cfg.cpus_per_node} CPUs per node"
        threads = "counted on the node" if cfg.omp_threads is None else str(cfg.omp_threads)
        layout += f", {cpus} (OMP_NUM_THREADS {threads})"

    params, exact = ctx.parameters()
    ckpt = run_checkpoint_bytes(cfg, params)
    save_s = estimated_save_s(ckpt)
    est = f"checkpoint {human_bytes(ckpt)}{'' if exact else ' (estimated)'}, ~{save_s:.0f} s to save at an assumed {ASSUMED_WRITE_BPS / 1e6:.0f} MB/s"
    # The lead the trainer starts from (rundir.clock's one rule, with the plan's save estimate).
    lead = round(
        stop_lead_s(
            fixed_s=cfg.launch.stop_lead_s, save_s=planned_save_s(cfg), margin_s=cfg.launch.stop_margin_s
        )
    )
    if cfg.launch.stop_lead_s is None:
        lead_text = (
            f"stop lead ~{lead} s before any save is measured (then the slowest save measured sets it)"
        )
    else:
        lead_text = f"stop lead {lead} s"
        if lead < save_s + cfg.launch.stop_margin_s:
            f.warn(
                f"launch.stop_lead_s {lead} may be too short: {est}, plus launch.stop_margin_s "
                f"{cfg.launch.stop_margin_s}",
                "raise launch.stop_lead_s, or leave it null to use the measured save time",
            )

    train_s = _warn_if_attempts_barely_train(cfg, f, lead)
    every = c.every_steps if isinstance(c.every_steps, int) and c.every_minutes is None else None
    if every is not None and every > t.steps:
        f.warn(
            f"checkpoint.every_steps {every} > train.steps {t.steps}: no periodic checkpoint, "
            "a crash loses the whole run (stops and the end still save)",
            f"set checkpoint.every_steps to at most {t.steps}",
        )
    if every is not None and cfg.testing.step_sleep_s > 0:
        interval = every * cfg.testing.step_sleep_s
        if interval > max(train_s, 0):
            f.warn(
                f"one checkpoint interval takes at least {interval:.0f} s (every_steps x testing.step_sleep_s), "
                f"more than the ~{max(train_s, 0)} s an attempt trains: periodic saves never happen "
                "and each attempt relies on its stop save",
                "lower checkpoint.every_steps or raise scheduler.time_limit",
            )
    if shortfall := cfg.cpu_shortfall():
        f.warn(shortfall, "each rank keeps its loader workers and a checkpoint writer busy beside itself")
    for issue in validate_nccl_env(cfg.nccl.env):
        hint = f"use {issue.replacement}" if issue.replacement else "see 'hpclaunch nccl presets'"
        (f.fail if issue.severity == "error" else f.warn)(f"nccl.env.{issue}", hint)
    f.ok(f"{layout}; {lead_text}; {est}; {_save_interval_text(cfg)}")
    _check_memory(ctx, f, params, exact)
    _check_host_memory(ctx, f, params, exact)
    _check_snapshot_tmpfs(ctx, f, params, exact)
    return f.outcome()


def _warn_if_attempts_barely_train(cfg: RunConfig, f: Findings, lead: int) -> int:
    """Warn where the time limit leaves an attempt little time to train after its start and its
    stop lead (each attempt would train a step or two and be requeued, until the requeues run out);
    return the seconds it leaves."""
    s = cfg.scheduler
    train_s = s.time_limit_s - lead - ASSUMED_STARTUP_S
    if train_s < MIN_TRAIN_S:
        f.warn(
            f"scheduler.time_limit {s.time_limit} leaves ~{max(train_s, 0)} s of training per attempt "
            f"after startup (~{ASSUMED_STARTUP_S} s, assumed) and the stop lead ({lead} s)",
            "raise scheduler.time_limit: most of each attempt would be spent starting and saving",
        )
    return train_s


def _check_script_layout(ctx: CheckContext) -> Outcome:
    """A script's run: the layout, the stop lead and the save interval (the model, its batch and
    its memory are the script's; the ``script`` check's probe measures what a checkpoint holds)."""
    cfg = ctx.cfg
    s = cfg.scheduler
    f = Findings()
    lead = round(
        stop_lead_s(
            fixed_s=cfg.launch.stop_lead_s, save_s=planned_save_s(cfg), margin_s=cfg.launch.stop_margin_s
        )
    )
    lead_text = (
        f"stop lead ~{lead} s before any save is measured (then the slowest save measured sets it)"
        if cfg.launch.stop_lead_s is None
        else f"stop lead {lead} s"
    )
    _warn_if_attempts_barely_train(cfg, f, lead)
    for issue in validate_nccl_env(cfg.nccl.env):
        hint = f"use {issue.replacement}" if issue.replacement else "see 'hpclaunch nccl presets'"
        (f.fail if issue.severity == "error" else f.warn)(f"nccl.env.{issue}", hint)
    f.ok(
        f"{s.nodes} node(s) x {s.nprocs} rank(s) = {s.world_size} ({cfg.backend}) running "
        f"{Path(str(cfg.script.path)).name}; {lead_text}; {_save_interval_text(cfg)}"
    )
    return f.outcome()


def _save_interval_text(cfg: RunConfig) -> str:
    c = cfg.checkpoint
    if c.every_minutes is not None:
        return f"periodic saves every ~{c.every_minutes:g} min"
    if c.every_steps == "auto":
        mtbf_h = c.mtbf_hours / cfg.scheduler.nodes
        return (
            f"periodic saves at the interval losing the least expected time (sqrt(2 x measured save "
            f"cost x MTBF), MTBF {mtbf_h:g} h: {c.mtbf_hours:g} h per node / {cfg.scheduler.nodes})"
        )
    return f"periodic saves every {c.every_steps} steps"


def _host_budget(ctx: CheckContext) -> tuple[int | None, str]:
    """Bytes of host memory one node has: ``scheduler.mem_gb``, else this machine's where it is the node."""
    mem_gb = ctx.cfg.scheduler.mem_gb
    if mem_gb is not None:
        return int(mem_gb * 1e9), "scheduler.mem_gb"
    if ctx.sees_compute_hardware:
        total = _mem_total()
        if total is not None:
            return total, f"{ctx.hostname}'s memory"
    return None, ""


def _mem_total() -> int | None:
    try:
        for line in open("/proc/meminfo").read().splitlines():  # noqa: SIM115 (one small read)
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_host_memory(ctx: CheckContext, f: Findings, params: int, exact: bool) -> None:
    cfg = ctx.cfg
    est = estimate_host_memory(cfg, params)
    text = f"host memory per node ~{est.describe()}{'' if exact else ' [parameters estimated]'}"
    budget, source = _host_budget(ctx)
    if budget is None:
        f.ok(f"{text}, not checked: the nodes' memory is unknown here (set scheduler.mem_gb to check it)")
    elif est.total > budget:
        f.fail(f"{text} does not fit {human_bytes(budget)} ({source})", _host_memory_hint(cfg))
    else:
        f.ok(f"{text} fits {human_bytes(budget)} ({source})")


def _check_snapshot_tmpfs(ctx: CheckContext, f: Findings, params: int, exact: bool) -> None:
    """The memory tier's snapshots against the node's tmpfs, where this machine is the node. Not
    fitting is a warning: the tier then says so and steps aside, the run goes on with the disk. A
    tmpfs that is not there at all fails the local scheduler's run (``submit`` refuses it too)."""
    cfg = ctx.cfg
    if cfg.checkpoint.memory.every_steps is None:
        return
    need = cfg.scheduler.nprocs * snapshot_tmpfs_bytes_per_rank(cfg, params)
    base = base_of(cfg.checkpoint.memory)
    text = f"memory tier ~{human_bytes(need)} per node in {base}{'' if exact else ' [parameters estimated]'}"
    if not ctx.sees_compute_hardware:
        f.ok(f"{text}, not checked here (the nodes' tmpfs)")
        return
    try:
        st = os.statvfs(base)
    except OSError:
        hint = "set checkpoint.memory.dir to the nodes' tmpfs (e.g. /dev/shm), or null for /dev/shm"
        if not ctx.on_node:  # the local scheduler: here is the node, and submit refuses it as well
            f.fail(f"{text}: {base} does not exist, and the run runs on this machine", hint)
        else:  # a node without it: the tier steps aside there, the disk serves
            f.warn(f"{text}: {base} does not exist here", hint)
        return
    free = st.f_bavail * st.f_frsize
    if need > free:
        f.warn(
            f"{text} does not fit its {human_bytes(free)} free: the tier would step aside (the disk serves)",
            "fewer snapshots kept (checkpoint.memory.keep_last), no copy on the next node "
            "(checkpoint.memory.replicas: 0), or a larger tmpfs (checkpoint.memory.dir)",
        )
    else:
        f.ok(f"{text} fits its {human_bytes(free)} free")


def _host_memory_hint(cfg: RunConfig) -> str:
    options = []
    if cfg.checkpoint.memory.every_steps is not None:
        options.append("fewer snapshots in memory (checkpoint.memory.keep_last) or none (every_steps: null)")
    if cfg.checkpoint.async_save:
        options.append("checkpoint.async_save: false (no staging copy; periodic saves then block training)")
    if cfg.train.parallel != "fsdp" and cfg.scheduler.world_size > 1:
        options.append("train.parallel: fsdp (each rank stages its shard only)")
    options.append("fewer ranks per node (scheduler.procs_per_node), or a larger scheduler.mem_gb")
    return "try " + "; ".join(options)


def _gpu_budget(ctx: CheckContext) -> tuple[int | None, str]:
    """Bytes one rank may use: the configured budget, else the smallest GPU the probe sees."""
    budget = ctx.cfg.train.memory_budget_gb
    if budget is not None:
        return int(budget * 1e9), "train.memory_budget_gb"
    devices = ((ctx.probe_result() or {}).get("torch") or {}).get("devices") or []
    sizes = [int(d["total_memory"]) for d in devices if isinstance(d.get("total_memory"), int)]
    if sizes:
        return min(sizes), f"{devices[0].get('name', 'GPU')} as the probe sees it"
    return None, ""


def _check_memory(ctx: CheckContext, f: Findings, params: int, exact: bool) -> None:
    cfg = ctx.cfg
    if cfg.scheduler.gpus_per_node == 0:
        return  # CPU ranks: the node's memory, which the disk/node checks do not size either
    est = estimate_memory(cfg, params)
    t = cfg.train
    how = (t.parallel if cfg.scheduler.world_size > 1 else "one rank, unwrapped") + (
        ", activation checkpointing" if t.activation_checkpointing else ""
    )
    text = f"memory per GPU ~{est.describe()} [{how}, micro-batch {cfg.micro_batch}{'' if exact else ', parameters estimated'}]"
    budget, source = _gpu_budget(ctx)
    if budget is None:  # the usual login node: say the figure, check it where GPUs are seen
        f.ok(f"{text}, not checked: no GPU visible here (set train.memory_budget_gb to check it)")
    elif est.total > budget:
        f.fail(f"{text} does not fit {human_bytes(budget)} ({source})", _memory_hint(cfg))
    else:
        f.ok(f"{text} fits {human_bytes(budget)} ({source}){_fill_note(cfg, params, budget)}")


def _fill_note(cfg: RunConfig, params: int, budget: int) -> str:
    """What fills the GPU: the largest micro-batch whose estimate fits 90 % of ``budget`` (a margin
    for the estimate's error), when it is larger than the one configured."""
    largest = largest_micro_batch(cfg, params, int(0.9 * budget), limit=MICRO_BATCH_LIMIT)
    if largest <= cfg.micro_batch:
        return ""
    per_rank = cfg.per_rank_batch
    up_to = f"{largest}" if largest < MICRO_BATCH_LIMIT else f"{MICRO_BATCH_LIMIT} or more"
    if largest >= per_rank:
        step = (
            f"train.micro_batch {per_rank} (no accumulation), or a " if cfg.micro_batch < per_rank else "a "
        )
        return (
            f"; up to micro-batch {up_to} would fit: {step}larger train.global_batch fills the GPU "
            f"better (larger matrix products, fewer steps' overhead)"
        )
    divisors = [d for d in range(largest, cfg.micro_batch, -1) if per_rank % d == 0]
    if not divisors:
        return ""
    return f"; up to micro-batch {largest} would fit: train.micro_batch {divisors[0]} fills the GPU better"


def _memory_hint(cfg: RunConfig) -> str:
    t = cfg.train
    options = []
    if t.parallel != "fsdp" and cfg.scheduler.world_size > 1:
        options.append("train.parallel: fsdp (shards weights, gradients and optimizer state)")
    if not t.activation_checkpointing:
        options.append("train.activation_checkpointing: true")
    if cfg.micro_batch > 1:
        options.append(
            f"a smaller train.micro_batch (now {cfg.micro_batch}; accumulation keeps the global batch)"
        )
    if t.deterministic:
        options.append("train.deterministic: false (its fused attention keeps no attention matrix)")
    return "try " + "; ".join(options) if options else "use more GPUs per shard group or a smaller model"
