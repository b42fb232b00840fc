"""Snapshot jobs between two real processes on a gloo group (the buddy exchange), without training:
a rank whose staging failed still trades sizes, so its buddy and its ward never wait for ever, and
its own shard is never published while the other's is, on both nodes."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.spawns


def _rank(rank: int, port: int, root: str, out: str) -> None:
    import torch.distributed as dist

    from hpclaunch.trainer.checkpoint.staging import SharedStager
    from hpclaunch.trainer.snapshots.store import NodeStore, describe_json
    from hpclaunch.trainer.snapshots.transfer import JobThread, SnapshotJob, new_link

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    link = new_link(1 - rank, 1 - rank)  # two nodes of one rank: each the other's buddy and ward
    store = NodeStore(Path(root), f"n{rank}", "1.0")
    jobs = JobThread()
    errors = []
    for step in (5, 10):
        staged, finish = SharedStager().stage_later({"w": torch.full((4,), float(rank + step))})
        failing = rank == 1 and step == 10  # rank 1's staging of step 10 failed in its loop
        job = jobs.submit(
            SnapshotJob(
                store,
                staged=None if failing else staged,
                finish=None if failing else finish,
                describe=lambda s, step=step: describe_json({"nbytes": s.layout.nbytes, "step": step}),
                step=step,
                world=2,
                rank=rank,
                link=link,
                keep_last=2,
                error="staging failed" if failing else None,
            )
        )
        assert job.join(timeout=60), f"rank {rank}: the job of step {step} never ended"
        errors.append(job.error)
    jobs.close()
    Path(out).write_text(repr(errors))
    dist.barrier()  # (as the trainer ends: a lazily connected group torn down while its peer still
    # talks on it aborts the process)
    dist.destroy_process_group()


def test_a_rank_whose_staging_failed_still_trades_and_publishes_nothing_of_its_own(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [tmp_path / f"out{r}" for r in range(2)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path / "shm"), str(outs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert outs[0].read_text() == "[None, None]" and outs[1].read_text() == "[None, 'staging failed']"

    def held(node: str, step: int) -> list[int]:
        return sorted(
            int(p.name[5:10])
            for p in (tmp_path / "shm" / node).glob(f"alloc-1.0/step-{step:08d}-w2/rank-*.json")
        )

    assert held("n0", 5) == [0, 1] and held("n1", 5) == [0, 1]  # each its own and the other's
    assert held("n0", 10) == [0] and held("n1", 10) == [0]  # rank 1's shard of 10: nowhere
