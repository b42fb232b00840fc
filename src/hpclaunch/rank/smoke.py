"""The distributed smoke test every rank runs right after ``init_process_group``, before training.

A hang in the first collective of a real run is the most expensive way to learn that a rank is
missing or a node cannot reach another: the job sits until the NCCL timeout (10 min by default).
Here every rank passes ``monitored_barrier`` on a gloo group with a short timeout (rank 0 learns
*which* ranks did not arrive: ``wait_all_ranks=True``), then one ``all_reduce`` through the training
backend proves the data path and its result. Every rank publishes its host in the rendezvous store
first, so rank 0 can name the host of a slow rank.

Test hook: ``HPCLAUNCH_SMOKE_DELAY=RANK:SECONDS`` makes that rank sleep before the barrier.
"""

from __future__ import annotations

import os
import re
import socket
import time
from datetime import timedelta
from typing import Any

from ..errors import PreflightFailed

DELAY_VAR = "HPCLAUNCH_SMOKE_DELAY"
_HOST_KEY = "hpclaunch/smoke/host/{rank}"


class StartupHang(PreflightFailed):
    """Ranks that did not reach the smoke test's barrier in time: a hang at start-up whose culprits
    are known (rank 0 names them). The run continues within ``scheduler.max_hang_retries``, never
    failed as if its own code or data were at fault."""

    def __init__(self, message: str, *, ranks: list[int], where: str, hint: str):
        super().__init__(message, where=where, hint=hint)
        self.ranks = tuple(ranks)


def run_distributed_smoke(timeout_s: float, group: Any = None) -> None:
    """Barrier + all_reduce across all ranks within ``timeout_s``; PreflightFailed names missing ranks.

    ``group``: a gloo process group to run the barrier on (the trainer's control group); None uses
    the default group when it is gloo, else creates a gloo group. Call it on every rank.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PreflightFailed("the distributed smoke test needs an initialised process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    node = os.environ.get("GROUP_RANK")
    me = f"rank {rank} on {host}" + (f" (node {node})" if node is not None else "")
    store = _store()
    if store is not None:
        try:
            store.set(_HOST_KEY.format(rank=rank), me)
        except Exception:
            store = None
    timeout = timedelta(seconds=timeout_s)
    if group is None:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _test_delay(rank)

    start = time.monotonic()
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        missing = _missing_ranks(str(e))
        if missing:
            who = ", ".join(_describe(store, r) for r in missing)
            raise StartupHang(
                f"distributed smoke test: {who} did not reach the barrier within {timeout_s:g} s "
                f"({world} ranks)",
                ranks=missing,
                where=me,
                hint="a slow or dead node: check that rank's log; the node agent's checks name bad nodes",
            ) from None
        raise PreflightFailed(
            f"distributed smoke test: the barrier failed here ({_first_line(e)})",
            where=me,
            hint="rank 0's log names the rank that did not arrive",
        ) from None

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([float(rank + 1)], device=device)
    left = max(1.0, timeout_s - (time.monotonic() - start))
    try:
        work = dist.all_reduce(value, async_op=True)
        work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as e:
        raise PreflightFailed(
            f"distributed smoke test: all_reduce failed or took over {left:.0f} s ({_first_line(e)})",
            where=me,
            hint="rerun with nccl.preset: debug to see which transport NCCL picked",
        ) from None
    expected = world * (world + 1) / 2
    got = float(value.item())
    if got != expected:
        raise PreflightFailed(
            f"distributed smoke test: all_reduce returned {got}, expected {expected} over {world} ranks",
            where=me,
            hint="a corrupting link or GPU: run nccl-tests all_reduce_perf -c 1 on these nodes",
        )


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def _describe(store: Any, rank: int) -> str:
    key = _HOST_KEY.format(rank=rank)
    try:
        if store is not None and store.check([key]):
            return str(store.get(key).decode())
    except Exception:
        pass
    return f"rank {rank} (never started the smoke test)"


def _missing_ranks(message: str) -> list[int]:
    """Ranks named in gloo's ``Ranks 1, 3 failed to pass monitoredBarrier in 2000 ms``."""
    m = re.search(r"Ranks? ([\d,\s]+) failed to pass monitoredBarrier", message)
    return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else []


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _test_delay(rank: int) -> None:
    spec = os.environ.get(DELAY_VAR, "")
    target, _, seconds = spec.partition(":")
    if target.strip().isdigit() and int(target) == rank:
        time.sleep(float(seconds or 0))
