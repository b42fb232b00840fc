"""What a node agent hands its rank host: the environment (the same for every attempt of the
allocation) and each attempt's request (how many nodes, the rendezvous, what only that attempt's
ranks see)."""

from __future__ import annotations

import os

from ..rundir import NCCL_PRESET, JobPlan, Ledger, RunPaths
from ..rundir.attempt_records import RankRequest
from ..rundir.env import (
    ALLOCATION_VAR,
    ATTEMPT_VAR,
    JOIN_STDERR_VAR,
    NODE_DIR_TOKEN_VAR,
    NODE_DIR_VAR,
    NODE_NAME_VAR,
    PRELOAD_COMPILE_VAR,
    PRELOAD_VAR,
    PROGRESS_DIR_VAR,
    RUN_DIR_VAR,
)
from ..rundir.node_dir import NodeDir
from ..rundir.plan import rdzv_port_for
from ..schedulers.nodes import interface_of, rendezvous_address
from ..schedulers.protocol import NodeContext
from .allocation import Roster
from .hang_evidence import flight_recorder_env
from .node_progress import prepare_local_dir
from .node_run import NodeRun


def rank_host_environment(node: NodeRun, node_dir: NodeDir | None = None, token: str = "") -> dict[str, str]:
    """The rank host's environment, the same for every attempt of this allocation (the NCCL preset
    it resolves is recorded); ``node_dir``: this user's node-local directory, which the rank host
    proves it shares by writing ``token`` there (``rundir.node_dir``)."""
    plan, ctx, paths = node.plan, node.ctx, node.paths
    env = dict(os.environ)
    env.pop(NODE_DIR_VAR, None)  # (an agent started inside another's job must not pass its own on)
    env.pop(NODE_DIR_TOKEN_VAR, None)
    # The batch script exports these too, but launchers such as pbsdsh start agents with a
    # minimal environment: the plan is the source of truth. Under it, what only this node can say:
    # the NCCL preset's variables for its fabric (the plan's own, user's values win).
    env.update(_nccl_preset_env(plan, node.ledger))
    env.update(plan.env)
    if ctx.num_nodes > 1 and "GLOO_SOCKET_IFNAME" not in env:
        # gloo advertises the address its hostname resolves to, which may be loopback or a
        # network the other nodes cannot reach; pin it to the interface of our own address.
        iface = interface_of(node.scheduler.node_address(ctx.hostname))
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
    env[RUN_DIR_VAR] = str(paths.root)
    env[JOIN_STDERR_VAR] = "1"
    env[NODE_NAME_VAR] = ctx.hostname  # ranks report their node as the scheduler names it
    env[ALLOCATION_VAR] = ctx.allocation  # (the memory tier's snapshots belong to one allocation)
    if plan.agent.program == "script":  # the script's slow imports first, then torch's and the rank package's
        env[PRELOAD_VAR] = ",".join([*plan.agent.script_preload, "hpclaunch.rank.script_preload"])
    elif plan.agent.compile:  # the compiler imported once per allocation too (trainer.preload_compile)
        env[PRELOAD_COMPILE_VAR] = "cuda" if plan.backend == "nccl" else "cpu"
    if node_dir is not None:
        env[NODE_DIR_VAR] = str(node_dir.ranks_path)
        env[NODE_DIR_TOKEN_VAR] = token
    env.pop("SUBMITIT_EXECUTOR", None)
    return env


def rank_host_command(
    plan: JobPlan, ctx: NodeContext, paths: RunPaths, env: dict[str, str], node_dir: NodeDir | None = None
) -> tuple[list[str], dict[str, str]]:
    """The command that starts this node's rank host (in the run's image, when it has one, with
    ``node_dir`` mounted) and the runtime's own environment for the ranks' ``env``
    (``ContainerPlan.environment``)."""
    container = plan.container
    if container is None:
        return plan.rank_host_argv(), env
    # A container runtime mounts only what exists: the checkpoint directory may not yet.
    paths.checkpoints.mkdir(parents=True, exist_ok=True)
    mounted = str(node_dir.path) if node_dir is not None else None
    argv = plan.rank_host_argv(node=ctx.hostname, node_dir=mounted, env=env)
    return argv, container.environment(env)


def _nccl_preset_env(plan: JobPlan, ledger: Ledger) -> dict[str, str]:
    """The NCCL preset's variables on this node (``auto``, ``debug``: from its fabric; a named
    preset: its table, which the plan's environment states already), recorded with the values the
    ranks get: the plan's (``nccl.env``, ``launch.env``) over the preset's, as on the login side."""
    if plan.backend != "nccl":
        return {}
    from ..nccl import resolve_preset

    preset = resolve_preset(plan.nccl_preset)
    seen = {**preset.env, **plan.env}
    names = sorted({*preset.env, *(k for k in plan.env if k.startswith("NCCL_"))})
    overridden = [k for k in names if k in preset.env and preset.env[k] != seen[k]]
    reason = preset.reason + (f"; the run's env overrides {', '.join(overridden)}" if overridden else "")
    ledger.append(NCCL_PRESET, preset=preset.name, reason=reason, env={k: seen[k] for k in names})
    return dict(preset.env)


def attempt_env(
    attempt: str,
    plan: JobPlan,
    ctx: NodeContext,
    paths: RunPaths,
    node_dir: NodeDir | None = None,
) -> dict[str, str]:
    """What only this attempt's ranks see: its key, its clock, where its flight record goes, and
    where their heartbeats go: this node's directory, shared with its agent (``node_dir``), else
    (none that both see) the run directory, as without an agent."""
    env = {ATTEMPT_VAR: attempt}
    if node_dir is not None:  # (its agent keeps one file per node: ``node_progress``)
        local = prepare_local_dir(node_dir.path, paths.root, ctx.hostname, attempt)
        env[PROGRESS_DIR_VAR] = str(node_dir.for_ranks(local))
    if ctx.clock is not None:
        env.update(ctx.clock.to_env())
    if plan.backend == "nccl" and plan.nccl_preset != "none":
        env.update(flight_recorder_env(paths, attempt))
    return env


def rank_request(node: NodeRun, roster: Roster, node_dir: NodeDir | None = None) -> RankRequest:
    """This node's part of its attempt, for its rank host (torch's elastic launcher): the roster's
    first training node hosts the rendezvous."""
    attempt, plan, ctx, scheduler, paths = (
        node.attempt,
        node.plan,
        node.ctx,
        node.scheduler,
        node.paths,
    )
    nodes = len(roster.training)
    request: RankRequest = {
        "run_id": attempt,
        "nnodes": nodes,
        "nproc": plan.procs_per_node,
        "run_dir": str(paths.root),
        "log_dir": str(paths.attempt_logs(attempt) / f"elastic-node{ctx.node_rank}"),
        "env": attempt_env(attempt, plan, ctx, paths, node_dir),
        "program": plan.agent.program,
    }
    if nodes > 1:
        head = roster.training[0]
        port = rdzv_port_for(attempt, plan.agent.rdzv_port)
        request["rdzv_endpoint"] = f"{rendezvous_address(ctx, scheduler, head)}:{port}"
        # Who hosts the c10d store is decided here, not by hostname matching, which fails when
        # nodes share a hostname or resolve it to loopback (reference/local-slurm.md §8).
        request["rdzv_configs"] = {"is_host": ctx.hostname == head, "join_timeout": 600}
        request["local_addr"] = scheduler.node_address(ctx.hostname)
    return request
