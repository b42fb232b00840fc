"""torch's elastic launcher, as torchrun runs it, with every rank forked from one interpreter that
imported the trainer once: what the rank host does on a node (``hpclaunch.rank.host``).

    python preloaded_torchrun.py --nproc-per-node=N [--nnodes=K --node-rank=R
        --master-addr=A --master-port=P] RUN_DIR

The trainer's integration tests start ~80 launches of two or three ranks. Under plain torchrun
each rank is a fresh interpreter importing torch, mmdit and DCP (~4.4 core-s each on a 2-core
machine) beside torchrun's own (~1.7): the largest single share of the suite's CPU. Here the
launcher imports the trainer's preload, forks multiprocessing's forkserver from itself
(``rank.forkserver_fork``) and runs one round of ``elastic_launch`` (LocalElasticAgent, c10d
rendezvous, the same RANK/WORLD_SIZE/MASTER_* environment per rank, SIGTERM passed on to the
ranks) with the rank host's own rank entry (``rank.host.rank_main``). A rank that fails makes the
launcher exit 1, as torchrun does. The trainer's behaviour under a plain torchrun keeps its own
tests (``trainer_helpers.command(..., plain_torchrun=True)``).
"""

from __future__ import annotations

import argparse
import sys
import uuid


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=0)
    parser.add_argument("run_dir")
    args = parser.parse_args()

    import multiprocessing
    from multiprocessing import forkserver

    from hpclaunch.rank import host
    from hpclaunch.rank.host import PRELOAD, _fork_forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    if not _fork_forkserver():
        forkserver.ensure_running()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    static = args.nnodes > 1  # torchrun's static rendezvous: node 0 hosts the store at master-port
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=f"preloaded-{args.master_port}" if static else uuid.uuid4().hex,
        role="trainer",
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_backend="static" if static else "c10d",
        rdzv_configs={"rank": args.node_rank} if static else {"is_host": True},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver",
    )
    try:
        elastic_launch(config, host.rank_main)(args.run_dir, {}, "mmdit")
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        print(
            f"preloaded torchrun: ChildFailedError: exit codes by rank {codes}", file=sys.stderr, flush=True
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
