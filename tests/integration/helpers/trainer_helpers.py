"""Helpers for the trainer's integration tests: a synthetic dataset, a run directory, torchrun.

Imported by path (``sys.path``) from ``tests/integration/test_trainer_*.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpclaunch.config import load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.shards import synth_dataset

# A small model and run: ~40 ms a step with 2 gloo ranks on 2 cores.
BASE = [
    "scheduler.gpus_per_node=0",
    "scheduler.procs_per_node=2",
    "train.steps=60",
    "train.global_batch=16",
    "train.micro_batch=4",  # 8 per rank -> 2 micro-batches: accumulation and no_sync run too
    "train.lr=1e-3",
    "train.warmup_steps=5",
    "train.log_every=1",
    "checkpoint.every_steps=1000",
    "preflight.distributed_smoke=false",
]


# One narrow block: the smallest MMDiT worth compiling or profiling in one process.
ONE_BLOCK = [
    "model.depth=1",
    "model.dim_text=32",
    "model.dim_latent=32",
    "model.dim_cond=32",
    "model.heads=2",
]
ONE_BLOCK += ["model.text_len=16", "model.latent_len=4", "model.latent_dim=8", "model.vocab_size=64"]


def make_data(root: Path, samples: int = 512, seed: int = 0) -> Path:
    out = root / "data"
    if not (out / "tokens").exists():
        synth_dataset(out, samples=samples, seed=seed, model_cfg=load_config(None).model, shard_size=128)
    return out


def make_run(root: Path, name: str, data: Path, overrides: list[str] = ()) -> Path:  # type: ignore[assignment]
    run = root / name
    cfg = load_config(
        None,
        [
            *BASE,
            f"data.token_dir={data / 'tokens'}",
            f"data.latent_dir={data / 'latents'}",
            f"run_dir={run}",
            *overrides,
        ],
        base=root,
    )
    RunPaths(run).ensure()
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run


PRELOADED_TORCHRUN = Path(__file__).with_name("preloaded_torchrun.py")
PLAIN_TORCHRUN_VAR = "HPCLAUNCH_TEST_PLAIN_TORCHRUN"  # "1": every launch a plain torchrun (to compare)


def command(
    run: Path, nproc: int = 2, *, plain_torchrun: bool = False, node: tuple[int, int, int] | None = None
) -> list[str]:
    """The trainer on ``nproc`` ranks of this machine: torch's elastic launcher with the ranks forked
    from one interpreter that imported the trainer once (``preloaded_torchrun.py``, as the rank
    host does), or ``plain_torchrun`` (every rank its own interpreter); ``nproc`` 0: one plain
    process, no launcher. ``node``: (nodes, this node's rank, port): one node of a static
    rendezvous on 127.0.0.1 instead of a standalone one."""
    if nproc == 0:
        return [sys.executable, "-m", "hpclaunch.trainer", str(run)]
    nodes = []
    if node is not None:
        nnodes, node_rank, port = node
        nodes = [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
    ranks = f"--nproc-per-node={nproc}"
    if not plain_torchrun and os.environ.get(PLAIN_TORCHRUN_VAR) != "1":
        return [sys.executable, str(PRELOADED_TORCHRUN), *nodes, ranks, str(run)]
    where = nodes or ["--standalone"]
    return [sys.executable, "-m", "torch.distributed.run", *where, ranks, "-m", "hpclaunch.trainer", str(run)]


def env_for(attempt: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HPCLAUNCH_ATTEMPT_CLOCK", None)
    env.update({"HPCLAUNCH_ATTEMPT": attempt, "OMP_NUM_THREADS": "1"})
    env.update(extra or {})
    return env


def train(
    run: Path, *, nproc: int = 2, attempt: str = "a1", timeout: float = 180, plain_torchrun: bool = False
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(run, nproc, plain_torchrun=plain_torchrun),
        env=env_for(attempt),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def hpclaunch_cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The ``hpclaunch`` command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "hpclaunch", *args],
        env=env_for("cli"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(
    run: Path,
    *,
    nproc: int = 2,
    attempt: str = "a1",
    env: dict[str, str] | None = None,
    plain_torchrun: bool = False,
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command(run, nproc, plain_torchrun=plain_torchrun),
        env=env_for(attempt, env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def outcome(run: Path, attempt: str = "a1") -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RunPaths(run).outcome_file(attempt).read_text())
    return data


def metrics(run: Path) -> list[dict[str, Any]]:
    return read_jsonl(RunPaths(run).metrics)


def events(run: Path) -> list[dict[str, Any]]:
    return [e.record for e in read_events(RunPaths(run)).events]


def wait_for_step(run: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> int:
    """Block until metrics.jsonl shows ``step`` (or later); return the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = metrics(run)
        if lines and lines[-1]["step"] >= step:
            return int(lines[-1]["step"])
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}): {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
