"""``hpclaunch.attach``: the few lines a training script adds to get hpclaunch's guarantees.

::

    import hpclaunch
    run = hpclaunch.attach(model=model, optimizer=opt, scheduler=sched, data=loader, extra=meta)
    for step in run.steps(total=max_steps):   # the steps still to do, after whatever was restored
        loss = train_step(step)
        run.log(loss=loss)                    # optional: metrics, status, TensorBoard
        with run.phase("eval"):               # optional: a long phase that is not a hang
            evaluate()
    export(model)                             # reached only when every step is done

``attach`` is the restore point. It is called by every rank at the same point, after the script
has joined its process group (or without one, alone) and built what it trains; it registers the
objects, restores them, each rank's random states and data position and the step from the newest
valid copy (the memory tier's, then the disk's, at any world size for the disk's), and returns the
``Run`` whose ``steps`` owns the boundary between steps (``run``). Under hpclaunch (``submit
--script``, ``train --script``) the run's config says how to save and watch; standalone (plain
``python`` or ``torchrun``) the run keeps its own directory (``site``) and SIGTERM, SIGUSR1 and
SIGINT stop every rank after the same step with a save.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UserInputError
from . import session as sessions
from .data_position import data_position
from .dist import DistContext, context_now
from .objects import Attached
from .run import Run, RunHooks
from .script_probe import PROBE_VAR, ProbeDone
from .site import RankSite
from .tiers import Hashes, make_checkpointer, make_memory_tier

__all__ = ["attach", "open_run"]

_attached: Run | None = None


def attach(
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    scheduler: Any = None,
    data: Any = None,
    extra: dict[str, Any] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    every_steps: int | str | None = None,
    keep_last: int | None = None,
    **objects: Any,
) -> Run:
    """Register and restore this rank's training objects; see the module docstring.

    ``model``: a module (DDP, FSDP2 or plain); ``optimizer``: its optimizer, or a list;
    ``scheduler``, ``extra`` (a dict of plain values, updated in place on restore) and any other
    named object with ``state_dict``/``load_state_dict``: saved and restored with them;
    ``data``: the DataLoader (or its sampler, or a stateful loader) whose position is kept.
    Standalone only (under hpclaunch the run's config decides): ``run_dir`` (default
    ``$HPCLAUNCH_RUN_DIR``, else ``runs/<script name>``), ``every_steps`` (periodic saves; "auto":
    the interval that loses the least time) and ``keep_last``."""
    global _attached
    if _attached is not None and not _attached._closed:
        raise UserInputError("hpclaunch.attach() is called once per process", where="hpclaunch.attach()")
    refuse_ranks_without_a_group()
    options: dict[str, Any] = {}
    if every_steps is not None:
        options["checkpoint.every_steps"] = every_steps
    if keep_last is not None:
        options["checkpoint.keep_last"] = keep_last
    session = sessions.current() or sessions.begin(RankSite.find(run_dir, **options))
    session.startup.mark("model")  # the script's own imports and building, until now
    opts = (
        []
        if optimizer is None
        else [optimizer]
        if isinstance(optimizer, torch.optim.Optimizer)
        else list(optimizer)
    )
    ctx = context_now(_device_of(model))
    named = {"scheduler": scheduler, "extra": extra, **objects}
    attached = Attached(
        model=model,
        optimizers=opts,
        objects=named,
        data=data_position(data) if data is not None else None,
        rank=ctx.rank,
        device=ctx.device,
    )
    if os.environ.get(PROBE_VAR):  # preflight's probe: say what would be saved, and leave
        raise ProbeDone(_measure(attached, ctx))
    hashes = {"config_hash": _script_hash(session.site), "model_hash": attached.shape_hash()}
    run = open_run(session, ctx, attached, hashes=hashes)
    if not session.site.managed:
        atexit.register(_close_standalone, run)
    _attached = run
    return run


def refuse_ranks_without_a_group() -> None:
    """Several ranks started (WORLD_SIZE > 1) and no process group joined: each would be rank 0 of
    one, all writing the same checkpoints and logs and training the same steps side by side."""
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1")
    joined = dist.is_available() and dist.is_initialized()
    if not joined and world.isdigit() and int(world) > 1:
        raise UserInputError(
            f"{world} ranks were started (WORLD_SIZE={world}) but this one joined no process group: "
            "each would train and save as the only rank; call torch.distributed.init_process_group() "
            "before attach(), or start one rank (scheduler.procs_per_node=1; verify-resume --ranks 1)",
            where="hpclaunch.attach()",
        )


def open_run(
    session: sessions.RankSession,
    ctx: DistContext,
    attached: Attached,
    *,
    hashes: Hashes,
    hooks: RunHooks | None = None,
    checkpoints: bool = True,
    echo: bool = True,
) -> Run:
    """The run of ``attached`` (the MMDiT trainer calls this with its hooks): the tiers made, the
    optimizers' updates wait for a save's staging copies, the state restored (collective)."""
    site = session.site
    session.join(ctx.rank, ctx.world_size, ctx.host_group())
    session.progress.cpu_time = ctx.device.type == "cpu"
    checkpointer = (
        make_checkpointer(site.cfg, ctx, site.paths, session.ledger, hashes) if checkpoints else None
    )
    memory = None
    if checkpoints and site.managed:  # (memory lives for an allocation: only an agent frees it)
        memory = make_memory_tier(site.cfg, ctx, site.paths, session.ledger, hashes)
    run = Run(session, ctx, attached, checkpointer=checkpointer, memory=memory, hooks=hooks, echo=echo)
    for opt in attached.optimizers:
        opt.register_step_pre_hook(lambda *_: run.before_update())
    try:
        run.restore()
    except BaseException:
        run.close()
        raise
    return run


def _measure(attached: Attached, ctx: DistContext) -> dict[str, Any]:
    """One rank's state as a checkpoint would hold it (the optimizer's state made first)."""
    from .tensors import local

    state = attached.state({"step": 0})
    nbytes = 0
    stack: list[Any] = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.Tensor):
            t = local(item)
            nbytes += t.numel() * t.element_size()
    model = attached.model
    return {
        "state_bytes": int(nbytes),
        "params": sum(p.numel() for p in model.parameters()) if model is not None else 0,
        "objects": attached.names,
        "device": str(ctx.device),
    }


def _device_of(model: nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    for p in model.parameters():
        return p.device if p.device.type != "meta" else None
    return None


def _script_hash(site: RankSite) -> str:
    """What identifies a script's run beside its model's shapes: the script and its arguments."""
    s = site.cfg.script
    text = json.dumps({"path": s.path, "args": s.args} if s.path else {"standalone": site.paths.root.name})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _close_standalone(run: Run) -> None:
    run.close()
    sessions.end()
