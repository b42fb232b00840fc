"""GPU check, ready to run on a machine with one or more GPUs: ``make gpu-check``.

What it measures, each with the real trainer (``python -m hpclaunch.trainer RUN`` under torchrun on
every visible GPU, or one process with ``--cpu``):

1. throughput and MFU of bf16 FSDP2 steps of a ~1B-parameter MMDiT (``CONFIG_1B``): model FLOPs per
   sample from ``preflight.sizes.train_flops_per_sample`` (3 x the forward's multiply-adds x 2, over
   each modality's own weights, the heads and the joint attention), divided by the median step time
   and by the GPUs' dense bf16 peak (``modelmath.peak_tflops`` by device name, or ``--peak-tflops``);
2. peak memory per GPU (``torch.cuda.max_memory_allocated``, the metrics' ``max_memory_gb``), next to
   preflight's estimate for the same config;
3. the async-checkpoint stall, for the process writer (the default) and the thread writer in the
   same check: what an asynchronous periodic save blocked training for (staging to pinned host
   memory, non-blocking copies; the ledger's ``stall_s``), the training it cost in all (the trainer's
   own measurement behind ``checkpoint.every_steps: auto``: the stall plus the slowdown of the steps
   beside the writer, ``checkpoint_interval.save_cost_s``), against the blocking save at the end;
4. determinism under the trainer's settings (``dist.set_deterministic``: deterministic kernels,
   cuDNN deterministic, TF32 off, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``): the same run twice, and a
   run stopped halfway and resumed, compared bitwise rank by rank (``state_sha256``: weights,
   AdamW state, EMA), with ``model.flash_attn`` off (attention as plain matmuls) and on (SDPA,
   whose flash/efficient backward kernels may accumulate in a nondeterministic order).

``--cpu`` runs the same code path on the CPU with a tiny model in fp32 (one process, FSDP2 on a
one-rank gloo group): everything but CUDA. Its figures mean nothing; the test suite runs it so that
the GPU path cannot rot. Results: printed, and written as JSON to ``--out``.

    make gpu-check                       # every visible GPU, the ~1B config
    .venv/bin/python bench/gpu_check.py --cpu --steps 6 --out /tmp/gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpclaunch import modelmath
from hpclaunch.config import RunConfig, load_config
from hpclaunch.fsutil import read_jsonl
from hpclaunch.preflight.sizes import estimate_memory, estimate_parameters, train_flops_per_sample
from hpclaunch.rundir import RunPaths, read_events
from hpclaunch.rundir.control import write_user_stop
from hpclaunch.shards import synth_dataset

# ~1.1B parameters: 16 blocks of width 1536 per modality, a 32k vocabulary, 256 + 256 tokens.
CONFIG_1B = [
    "model.vocab_size=32768", "model.text_len=256", "model.latent_len=256", "model.latent_dim=64",
    "model.depth=16", "model.dim_text=1536", "model.dim_latent=1536", "model.dim_cond=512",
    "model.heads=24", "model.dim_head=64", "train.parallel=fsdp", "train.precision=bf16",
    "train.micro_batch=8", "train.activation_checkpointing=true", "train.ema_decay=0.999",
]  # fmt: skip
CONFIG_CPU = ["train.parallel=fsdp", "train.precision=fp32", "train.ema_decay=0.9", "model.depth=2"]


def gpus() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        {"name": torch.cuda.get_device_name(i), "memory": torch.cuda.get_device_properties(i).total_memory}
        for i in range(torch.cuda.device_count())
    ]


def peak_tflops(name: str, given: float | None) -> float | None:
    return given or modelmath.peak_tflops(name)


class Runner:
    """Trainer runs in their own run directories (torchrun over ``nproc`` ranks; one process at 1)."""

    def __init__(self, root: Path, base: list[str], nproc: int, *, cpu: bool):
        self.root, self.base, self.nproc = root, base, nproc
        self.gpus_per_node = 0 if cpu else nproc

    def config(self, name: str, extra: list[str] = ()) -> tuple[RunConfig, Path]:  # type: ignore[assignment]
        run = self.root / name
        sets = [*self.base, *extra, f"scheduler.gpus_per_node={self.gpus_per_node}"]
        sets += [f"scheduler.procs_per_node={self.nproc}", f"run_dir={run}"]
        cfg = load_config(None, sets, base=self.root)
        RunPaths(run).ensure()
        RunPaths(run).config.write_text(cfg.to_yaml())
        return cfg, run

    def command(self, run: Path) -> list[str]:
        if self.nproc == 1:
            return [sys.executable, "-m", "hpclaunch.trainer", str(run)]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "hpclaunch.trainer",
            str(run),
        ]

    def start(self, run: Path, attempt: str) -> subprocess.Popen[str]:
        env = {**os.environ, "HPCLAUNCH_ATTEMPT": attempt}
        env.pop("HPCLAUNCH_ATTEMPT_CLOCK", None)
        return subprocess.Popen(
            self.command(run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def train(self, run: Path, attempt: str = "a1", stop_at: int | None = None) -> dict[str, Any]:
        proc = self.start(run, attempt)
        if stop_at is not None:
            while not (lines := read_jsonl(RunPaths(run).metrics)) or lines[-1]["step"] < stop_at:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
            write_user_stop(RunPaths(run), continue_=False, attempt=None, by="gpu_check")
        out, _ = proc.communicate()
        RunPaths(run).stop_file.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise SystemExit(f"trainer failed in {run} (exit {proc.returncode}):\n{out[-4000:]}")
        result: dict[str, Any] = json.loads(RunPaths(run).outcome_file(attempt).read_text())
        if stop_at is None:  # read what it needs: a big model's checkpoints would fill the disk
            shutil.rmtree(RunPaths(run).checkpoints, ignore_errors=True)
        return result


def check(args: argparse.Namespace) -> dict[str, Any]:
    devices = [] if args.cpu else gpus()
    if not args.cpu and not devices:
        raise SystemExit("no CUDA device visible: run with --cpu for the CPU path, or on a GPU machine")
    nproc = 1 if args.cpu else (args.nproc or len(devices))
    steps = args.steps
    half = steps // 2
    base = [
        *(CONFIG_CPU if args.cpu else CONFIG_1B),
        f"train.steps={steps}",
        "train.warmup_steps=1",
        "train.log_every=1",
    ]
    base += [
        f"train.global_batch={args.batch_per_gpu * nproc}",
        f"checkpoint.every_steps={max(1, half // 2)}",
    ]
    base += [
        "checkpoint.keep_last=2",
        "preflight.distributed_smoke=false",
        "data.num_workers=2",
        *args.overrides,
    ]
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        runner = Runner(root, base, nproc, cpu=args.cpu)
        cfg, _ = runner.config("probe")
        synth_dataset(
            root / "data",
            samples=max(256, cfg.train.global_batch * 4),
            seed=0,
            model_cfg=cfg.model,
            shard_size=256,
        )
        runner.base += [
            f"data.token_dir={root / 'data' / 'tokens'}",
            f"data.latent_dir={root / 'data' / 'latents'}",
        ]
        report: dict[str, Any] = {"devices": devices, "nproc": nproc, "cpu": args.cpu, "steps": steps}
        report["config"] = list(runner.base)

        cfg, run = runner.config("throughput")
        first = runner.train(run)
        lines = read_jsonl(RunPaths(run).metrics)
        step_s = statistics.median(line["step_time_s"] for line in lines[2:] or lines)
        params = estimate_parameters(cfg.model)
        flops = train_flops_per_sample(cfg.model) * cfg.train.global_batch
        peak = peak_tflops(devices[0]["name"], args.peak_tflops) if devices else args.peak_tflops
        report["throughput"] = {
            "parameters": params,
            "flops_per_step": flops,
            "step_s": step_s,
            "samples_per_s": cfg.train.global_batch / step_s,
            "achieved_tflops_per_gpu": flops / step_s / nproc / 1e12,
            "peak_tflops_per_gpu": peak,
            "mfu": (flops / step_s / nproc / (peak * 1e12)) if peak else None,
        }
        report["throughput"]["first_step_s"] = lines[0]["step_time_s"]  # compilation shows here
        report["mode"] = {
            "deterministic": cfg.train.deterministic,
            "compile": cfg.train.compile,
            "flash_attn": cfg.model.flash_attn,
            "activation_checkpointing": cfg.train.activation_checkpointing,
            "micro_batch": cfg.train.micro_batch or cfg.train.global_batch // nproc,
            "global_batch": cfg.train.global_batch,
        }
        profile = RunPaths(run).root / "profile"
        if (profile / "rank0.json").exists():
            report["profile"] = json.loads((profile / "rank0.json").read_text())
            if args.out:
                shutil.copy(profile / "rank0.txt", args.out.with_suffix(".profile.txt"))
        estimate = estimate_memory(cfg, params)
        save_partial(args, report)
        report["memory"] = {
            "peak_gb_rank0": max(line["max_memory_gb"] for line in lines),
            "estimate_gb": estimate.total / 1e9,
        }
        writers = {"process": checkpoint_figures(run)}
        if "thread-writer" in args.parts:
            _, thread_run = runner.config("checkpoint-thread", ["checkpoint.writer=thread"])
            runner.train(thread_run)
            writers["thread"] = checkpoint_figures(thread_run)
        report["checkpoint"] = {**writers["process"], "writers": writers}
        save_partial(args, report)
        report["determinism"] = {}
        variants = ("false", "true") if args.flash == "both" else (args.flash,)
        for flash in variants if "determinism" in args.parts else ():
            sets = [f"model.flash_attn={flash}"]
            _, again = runner.config(f"again-flash-{flash}", sets)
            _, ref = runner.config(f"ref-flash-{flash}", sets)
            reference = first if flash == str(cfg.model.flash_attn).lower() else runner.train(ref)
            repeat = runner.train(again)
            _, resumed = runner.config(f"resumed-flash-{flash}", sets)
            stopped = runner.train(resumed, "a1", stop_at=half)
            final = runner.train(resumed, "a2")
            ref_states = [r["state_sha256"] for r in reference["ranks"]]
            report["determinism"][f"flash_attn={flash}"] = {
                "same_seed_bitwise": [r["state_sha256"] for r in repeat["ranks"]] == ref_states,
                "stopped_at": stopped["step"],
                "resume_bitwise": [r["state_sha256"] for r in final["ranks"]] == ref_states,
            }
            save_partial(args, report)
        return report


def save_partial(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """What is measured so far, to ``--out`` (a lease that ends early keeps it)."""
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def checkpoint_figures(run: Path) -> dict[str, Any]:
    """A run's periodic saves from its ledger: the stall, the background write, the training each
    cost (the trainer's own measurement), the blocking save at the end."""
    events = [e.record for e in read_events(RunPaths(run)).events]
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    async_saves = [e for e in saves if not e["blocking"]]
    blocking = [e for e in saves if e["blocking"]]
    costs = [e["save_cost_s"] for e in events if e["event"] == "checkpoint_interval" and e.get("save_cost_s")]
    blocking_s = blocking[-1]["seconds"] if blocking else None
    lost = costs[-1] if costs else None  # averaged over the last saves by the trainer
    return {
        "async_stall_s": statistics.median(e["stall_s"] for e in async_saves) if async_saves else None,
        "async_write_s": statistics.median(e["seconds"] for e in async_saves) if async_saves else None,
        "async_lost_s": lost,
        "lost_over_blocking": lost / blocking_s if lost is not None and blocking_s else None,
        "blocking_s": blocking_s,
        "bytes": saves[-1]["bytes"] if saves else None,
    }


def print_report(r: dict[str, Any]) -> None:
    where = (
        "CPU (tiny model, fp32: the code path only, not a figure)"
        if r["cpu"]
        else f"{r['nproc']} x {r['devices'][0]['name']}"
    )
    t, m, c = r["throughput"], r["memory"], r["checkpoint"]
    print(f"gpu check on {where}, {r['steps']} steps")
    mfu = f"{t['mfu']:.1%}" if t["mfu"] is not None else "n/a (no peak known: --peak-tflops)"
    print(
        f"  {t['parameters'] / 1e9:.2f}B parameters, {t['flops_per_step'] / 1e12:.1f} TFLOP/step: step {t['step_s'] * 1000:.1f} ms, {t['samples_per_s']:.1f} samples/s, {t['achieved_tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {mfu}"
    )
    print(f"  peak memory rank 0: {m['peak_gb_rank0']:.2f} GB (preflight estimate {m['estimate_gb']:.2f} GB)")
    for writer, w in c["writers"].items():
        if w["async_stall_s"] is None:
            continue
        lost = (
            f", training lost per save {w['async_lost_s'] * 1000:.1f} ms = {w['lost_over_blocking']:.3f} of the blocking save"
            if w["async_lost_s"] is not None and w["lost_over_blocking"] is not None
            else ""
        )
        print(
            f"  checkpoint ({(w['bytes'] or 0) / 1e9:.2f} GB), {writer} writer: async save stalled training {w['async_stall_s'] * 1000:.1f} ms (written in {w['async_write_s']:.2f} s){lost}; blocking save {w['blocking_s']:.2f} s"
        )
    for variant, d in r["determinism"].items():
        print(
            f"  {variant}: same seed bitwise {d['same_seed_bitwise']}, stopped at {d['stopped_at']} and resumed bitwise {d['resume_bitwise']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU path with a tiny model (no figures)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-per-gpu", type=int, default=16)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (else by name)")
    ap.add_argument(
        "--flash",
        choices=("both", "false", "true"),
        default="both",
        help="model.flash_attn variants of the determinism check",
    )
    ap.add_argument(
        "--parts",
        type=lambda v: set(v.split(",")),
        default={"thread-writer", "determinism"},
        help="what to run beside the throughput run (itself with the process writer's saves), "
        "comma-separated: thread-writer, determinism (default both); '' for the throughput run alone",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--tmp", default=None, help="where the run directories go (default: the system's tmp)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--smoke", action="store_true", help="--cpu: the code path in seconds (make test runs it)"
    )
    args = ap.parse_args()
    args.cpu = args.cpu or args.smoke
    if args.cpu and args.batch_per_gpu == 16:
        args.batch_per_gpu = 4
    report = check(args)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
