"""torchrun worker for the checkpoint integration tests (gloo, CPU).

Usage: torchrun --standalone --nproc-per-node=N ckpt_worker.py MODE RUN_DIR
       python ckpt_worker.py MODE RUN_DIR      (one process, torch.distributed not initialized)

Modes:
  roundtrip  uninterrupted run vs. run saved at step K (async, live tensors mutated right after
             the save returns) and resumed into freshly built objects: must match bitwise.
  crash      blocking save of step 10, then an async save of step 20 during which the test hook
             HPCLAUNCH_TEST_CKPT_KILL (set by the test) SIGKILLs one rank.
  resume     load_latest into fresh state and report what was loaded.
  diskfull   a blocking save of step 30 while the test's HPCLAUNCH_TEST_CKPT_FAIL makes one rank's
             writer fail (ENOSPC): every rank reports the error it got.
  writerkill blocking save of step 10, async save of step 20 during which the test hook kills one
             rank's writer process; every rank reports the error, saves step 20 again blocking (as
             the trainer does), then step 30 in the background with new writers.

  closealone both ranks start a background save, rank 1 closes at once while rank 0 waits for it in
             another collective (a rank leaving on an error must not need the others to close).

CKPT_WRITER=thread|process (default process) picks the background writer; with process, each rank
forks its first writer before its first thread, as the trainer does (the result's "writer_forked").
CKPT_OPEN_FDS=N opens N descriptors (duplicates of /dev/null) in each rank before anything else, so
that every socket the rank opens afterwards (gloo's, the writer's channel) is numbered above N; the
result then says how many descriptors the rank held at its end ("open_fds").

Each rank writes RUN_DIR/result-MODE-rank<r>.json for the test to read.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from hpclaunch.errors import CheckpointError
from hpclaunch.rank.checkpoint import (
    ENV_DELAY_WRITE,
    RANK_LOCAL,
    Checkpointer,
    RunCheckpoints,
    WriterSettings,
    rank_local_key,
)
from hpclaunch.rank.checkpoint.writer_process import prefork as prefork_writer
from hpclaunch.rundir import Ledger, RunPaths

K = 4  # save after K steps, then K more


def main() -> None:
    mode, run_dir = sys.argv[1], Path(sys.argv[2])
    dummies = open_dummy_fds(int(os.environ.get("CKPT_OPEN_FDS", "0")))
    distributed = "RANK" in os.environ  # started by torchrun
    # As the trainer does: the first writer forked before the rank's first thread (later ones start)
    forked = os.environ.get("CKPT_WRITER", "process") == "process" and prefork_writer()
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(name)s: %(message)s")
    modes = {
        "roundtrip": roundtrip,
        "crash": crash,
        "resume": resume,
        "diskfull": diskfull,
        "writerkill": writerkill,
        "closealone": closealone,
    }
    result = modes[mode](run_dir, rank, world)
    result["writer_forked"] = forked
    if dummies:
        result["open_fds"] = len(os.listdir("/proc/self/fd"))
    (run_dir / f"result-{mode}-rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def open_dummy_fds(n: int) -> list[int]:
    """n duplicates of /dev/null, the soft RLIMIT_NOFILE raised as far as it must (and may) go."""
    if not n:
        return []
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 512  # gloo, the store, the writer's channel, the staging buffer, imports
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard)
        )
    null = os.open(os.devnull, os.O_RDONLY)
    return [null] + [os.dup(null) for _ in range(n - 1)]


def checkpointer(run_dir: Path, rank: int, world: int) -> Checkpointer:
    return Checkpointer(
        RunCheckpoints(run_dir / "checkpoints", world, config_hash="cfg", model_hash="toy-v1", keep_last=3),
        rank=rank,
        writing=WriterSettings(
            writer=os.environ.get("CKPT_WRITER", "process"),  # type: ignore[arg-type]
            # Normal priority: on a loaded machine an idle-priority writer the rank waits for is
            # replaced (test_checkpoint_writer_starved), which these tests of one writer's faults
            # must not see.
            idle=False,
        ),
        ledger=Ledger(RunPaths(run_dir), role="trainer") if rank == 0 else None,
    )


# ---- roundtrip ----------------------------------------------------------------------------------


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def build(rank: int, init_seed: int) -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(init_seed)  # same init on every rank (DDP broadcasts rank 0's anyway)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train_step(model: DDP, opt: torch.optim.Optimizer) -> None:
    # Draws from the torch RNG (data, dropout) and Python's random: both must be restored.
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    loss = ((model(x) - y) ** 2).mean() * (1.0 + random.random())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def build_state(model: DDP, opt: torch.optim.Optimizer, step: int, rank: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "progress": {"step": torch.tensor(step), "samples": torch.tensor(step * 8)},
        RANK_LOCAL: {
            rank_local_key(rank): {
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
            }
        },
    }


def snapshot(model: DDP, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    model_sd, optim_sd = get_state_dict(model, opt)
    out = {f"model.{k}": v.detach().clone() for k, v in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            out[f"optim.{fqn}.{name}"] = torch.as_tensor(value).clone()
    return out


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def roundtrip(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    # A: uninterrupted, 2K steps.
    seed_all(100 + rank)
    model, opt = build(rank, init_seed=0)
    for _ in range(2 * K):
        train_step(model, opt)
    reference = snapshot(model, opt)

    # B: same start, K steps, async save; the writer waits so that the in-place updates of the
    # following steps happen before it writes: staging must have copied.
    seed_all(100 + rank)
    model, opt = build(rank, init_seed=0)
    for _ in range(K):
        train_step(model, opt)
    at_save = snapshot(model, opt)
    ckpt = checkpointer(run_dir, rank, world)
    os.environ[ENV_DELAY_WRITE] = "1.0"
    ckpt.save(K, build_state(model, opt, K, rank), blocking=False, extra={"samples_consumed": K * 8})
    stall = ckpt.last_stall_seconds
    for _ in range(K):
        train_step(model, opt)  # mutates the live parameters and Adam moments in place
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)
    ckpt.wait()
    del os.environ[ENV_DELAY_WRITE]
    save_seconds = ckpt.last_save_seconds
    ckpt.close()

    # C: fresh objects, different init and RNG; load step K, continue K steps.
    seed_all(999 + rank)
    model, opt = build(rank, init_seed=12345)
    ckpt = checkpointer(run_dir, rank, world)
    state = build_state(model, opt, 0, rank)
    loaded = ckpt.load_latest(state)
    assert loaded is not None
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    mine = state[RANK_LOCAL][rank_local_key(rank)]
    torch.set_rng_state(mine["torch_rng"])
    random.setstate(mine["python_rng"])
    after_load = snapshot(model, opt)
    for _ in range(K):
        train_step(model, opt)
    ckpt.close()
    return {
        "loaded_step": loaded.info.step,
        "progress_step": int(state["progress"]["step"]),
        "samples": int(state["progress"]["samples"]),
        "manifest_extra": loaded.info.manifest["extra"],
        "staged_mismatch": bitwise_equal(at_save, after_load),
        "final_mismatch": bitwise_equal(reference, snapshot(model, opt)),
        "stall_s": stall,
        "save_s": save_seconds,
    }


# ---- crash / resume -----------------------------------------------------------------------------


def big_state(rank: int, step: int) -> dict[str, Any]:
    # ~8 MB shared + 2 MB per rank, values a function of the step so a load can be checked.
    return {
        "model": {"w": torch.full((2_000_000,), float(step)), "b": torch.arange(10.0) + step},
        "progress": {"step": torch.tensor(step)},
        RANK_LOCAL: {rank_local_key(rank): {"buf": torch.full((500_000,), float(step * 100 + rank))}},
    }


def crash(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    ckpt = checkpointer(run_dir, rank, world)
    ckpt.save(10, big_state(rank, 10), blocking=True)
    ckpt.save(20, big_state(rank, 20), blocking=False)  # the kill hook fires in here
    ckpt.wait()
    return {"survived": True}  # not reached when the hook works


def resume(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    ckpt = checkpointer(run_dir, rank, world)
    state = big_state(rank, -1)
    loaded = ckpt.load_latest(state)
    ckpt.close()
    if loaded is None:
        return {"loaded_step": None}
    local = state[RANK_LOCAL][rank_local_key(rank)]["buf"]
    return {
        "loaded_step": loaded.info.step,
        "skipped": [[str(p), reason] for p, reason in loaded.skipped],
        "ranks_without_rank_local": loaded.ranks_without_rank_local,
        "model_ok": bool((state["model"]["w"] == 10.0).all()),
        "progress_step": int(state["progress"]["step"]),
        "rank_local_value": float(local[0]),
    }


def diskfull(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    ckpt = checkpointer(run_dir, rank, world)
    try:
        ckpt.save(30, big_state(rank, 30), blocking=True)
        return {"error": None}
    except CheckpointError as e:
        return {"error": e.one_line(), "hint": e.hint}
    finally:
        ckpt.close()


def writerkill(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    ckpt = checkpointer(run_dir, rank, world)
    ckpt.save(10, big_state(rank, 10), blocking=True)
    ckpt.save(20, big_state(rank, 20), blocking=False)  # the kill hook fires in a writer process
    first = ckpt.writer_pid
    try:
        ckpt.wait()
        error = None
    except CheckpointError as e:
        error = e.one_line()
    os.environ.pop("HPCLAUNCH_TEST_CKPT_KILL", None)
    ckpt.save(20, big_state(rank, 20), blocking=True)  # the trainer's blocking retry
    ckpt.save(30, big_state(rank, 30), blocking=False)
    second = ckpt.writer_pid
    ckpt.close()
    return {"error": error, "first_writer": first, "second_writer": second}


def closealone(run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    """Both ranks start a background save; rank 1 then closes its checkpointer at once (as a rank
    leaving on an error does) while rank 0 waits in another collective for rank 1: the close must
    not need rank 0."""
    ckpt = checkpointer(run_dir, rank, world)
    ckpt.save(10, big_state(rank, 10), blocking=False)
    if rank == 1:
        ckpt.close()
    dist.barrier()  # rank 0 waits here, never in the checkpointer's group
    if rank == 0:
        ckpt.close()
    return {"closed": True}


if __name__ == "__main__":
    main()
