"""The step's speed on a GPU across kernel modes, compilation, model sizes and micro-batches, each in
a process of its own, most important first, in one bounded run (``bench/gpu_lease.sh``).

Each configuration builds the real trainer (``Trainer`` with ``train.parallel: fsdp`` on one GPU,
which trains the model itself, unwrapped, bf16 by autocast; EMA, grad clip; no checkpoints) and runs its real step (``Trainer.train_step``): warm-up steps (the first one
compiles), then timed steps (median), then, where asked, two profiled ones (``trainer.reporting.profiling``).
Reported per configuration (``summary.json``, a list): ``gpu``, ``params``, ``deterministic``,
``compile``, ``micro_batch``, ``global_batch``, ``step_s``, ``samples_per_s``, ``tflops``, ``mfu``
(model FLOPs of ``preflight.sizes.train_flops_per_sample`` over the dense bf16 peak),
``peak_memory_gb`` (``torch.cuda.max_memory_allocated``) beside ``estimate_gb`` (preflight's
estimate, without its runtime and fragmentation allowances, which allocated memory does not see),
``suggested_micro_batch`` (preflight's largest that fits 90 % of the GPU) and ``first_step_s``
(compilation shows there); ``profiles.json`` holds the profiles' summaries. Each configuration
gets what is left of ``--budget-s`` at most; one that fails or runs out of time is recorded with
its error and the next one runs.

``--cpu``: the same code path with a tiny model in fp32 on the CPU (its figures mean nothing; the
test suite runs it so the lease's script cannot rot).

    python3 bench/gpu_matrix.py --out /tmp/matrix --budget-s 400
    .venv/bin/python bench/gpu_matrix.py --cpu --out /tmp/matrix --only fast-compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import CONFIG_1B

SIZE_SETS = {
    "1b": [c for c in CONFIG_1B if not c.startswith(("train.micro_batch", "train.activation_checkpointing"))],
    "0.2b": [
        "model.vocab_size=32768", "model.text_len=256", "model.latent_len=256", "model.latent_dim=64",
        "model.depth=8", "model.dim_text=768", "model.dim_latent=768", "model.dim_cond=512", "model.heads=12",
        "model.dim_head=64", "train.parallel=fsdp", "train.precision=bf16", "train.ema_decay=0.999",
    ],
    "cpu": [
        "model.depth=2", "model.dim_text=32", "model.dim_latent=32", "model.dim_cond=32", "model.heads=2",
        "model.dim_head=16", "model.text_len=16", "model.latent_len=4", "model.latent_dim=8",
        "model.vocab_size=64", "train.parallel=fsdp", "train.precision=fp32", "train.ema_decay=0.999",
    ],
}  # fmt: skip

# (name, size, deterministic, compile, micro_batch (None: preflight's suggestion), global batch
# (None: the micro-batch, no accumulation), profile), in the order they run.
MATRIX: list[tuple[str, str, bool, bool, int | None, int | None, bool]] = [
    ("1b-fast-compiled-suggested", "1b", False, True, None, None, True),
    ("1b-fast-compiled-mb16", "1b", False, True, 16, 16, True),
    ("1b-det-compiled-suggested", "1b", True, True, None, None, False),
    ("1b-fast-eager-suggested", "1b", False, False, None, None, True),
    ("1b-det-eager-suggested", "1b", True, False, None, None, False),
    ("1b-fast-compiled-mb8", "1b", False, True, 8, 16, False),
    ("1b-det-eager-mb8", "1b", True, False, 8, 16, True),
    ("1b-fast-eager-mb8", "1b", False, False, 8, 16, False),
    ("1b-det-compiled-mb8", "1b", True, True, 8, 16, False),
    ("0.2b-fast-compiled-suggested", "0.2b", False, True, None, None, False),
    ("0.2b-det-compiled-suggested", "0.2b", True, True, None, None, False),
    ("0.2b-fast-eager-suggested", "0.2b", False, False, None, None, False),
    ("0.2b-det-eager-suggested", "0.2b", True, False, None, None, False),
    ("0.2b-fast-compiled-mb8", "0.2b", False, True, 8, 16, False),
    ("0.2b-det-eager-mb8", "0.2b", True, False, 8, 16, False),
]
CPU_MATRIX = [
    ("cpu-fast-compiled", "cpu", False, True, 4, 8, True),
    ("cpu-det-eager", "cpu", True, False, 4, 8, False),
]


def config_sets(
    size: str, deterministic: bool, compile: bool, micro: int, batch: int, steps: int, data: Path
) -> list[str]:
    return [
        *SIZE_SETS[size], f"train.deterministic={str(deterministic).lower()}", f"train.compile={str(compile).lower()}",
        f"train.micro_batch={micro}", f"train.global_batch={batch}", f"train.steps={steps}", "train.warmup_steps=1",
        "scheduler.procs_per_node=1", f"scheduler.gpus_per_node={0 if size == 'cpu' else 1}",
        "preflight.distributed_smoke=false", "data.num_workers=2", f"data.token_dir={data / 'tokens'}",
        f"data.latent_dir={data / 'latents'}",
    ]  # fmt: skip


def suggested_micro_batch(size: str, deterministic: bool, gpu_bytes: int) -> int:
    """Preflight's largest micro-batch that fits 90 % of the GPU, rounded down to a power of two."""
    from hpclaunch.config import load_config
    from hpclaunch.preflight.sizes import estimate_parameters, largest_micro_batch

    sets = [
        *SIZE_SETS[size],
        f"train.deterministic={str(deterministic).lower()}",
        "scheduler.procs_per_node=1",
    ]
    cfg = load_config(None, [*sets, f"scheduler.gpus_per_node={0 if size == 'cpu' else 1}"])
    largest = largest_micro_batch(cfg, estimate_parameters(cfg.model), int(0.9 * gpu_bytes))
    return 1 << max(0, largest.bit_length() - 1) if largest else 1


# ---- one configuration, in a process of its own -----------------------------------------------------


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hpclaunch.config import load_config
    from hpclaunch.modelmath import peak_tflops
    from hpclaunch.preflight.sizes import estimate_memory, estimate_parameters, train_flops_per_sample
    from hpclaunch.rundir import RunPaths
    from hpclaunch.trainer.loop import Trainer
    from hpclaunch.trainer.reporting.profiling import StepProfiler

    warmup, timed, profiled = spec["warmup"], spec["steps"], 2 if spec["profile"] else 0
    sets = config_sets(
        spec["size"], spec["deterministic"], spec["compile"], spec["micro_batch"], spec["global_batch"],
        warmup + timed + profiled, Path(spec["data"]),
    )  # fmt: skip
    cfg = load_config(None, [*sets, *spec.get("overrides", [])])
    cuda = torch.cuda.is_available() and spec["size"] != "cpu"
    t0 = time.perf_counter()
    trainer = Trainer(cfg, RunPaths(Path(spec["run"])).ensure(), checkpoints=False, echo=False)
    built_s = time.perf_counter() - t0
    try:
        batches = iter(trainer.feed.loader(trainer.data))
        times = []
        for _ in range(warmup + timed):
            t = time.perf_counter()
            trainer.train_step(next(batches))  # ends with the step's one host sync
            times.append(time.perf_counter() - t)
        profile = None
        if profiled:
            prof = StepProfiler(None, Path(spec["run"]) / "profile", 0, "cuda" if cuda else "cpu")
            from hpclaunch.config import ProfileKnob

            prof.knob, prof.done = ProfileKnob(start=trainer.counters.step + 1, steps=profiled), False
            for _ in range(profiled):
                prof.before_step(trainer.counters.step + 1)
                t = time.perf_counter()
                trainer.train_step(next(batches))
                prof.after_step(trainer.counters.step, time.perf_counter() - t)
            profile = json.loads((Path(spec["run"]) / "profile" / "rank0.json").read_text())
        step_s = statistics.median(times[warmup:])
        params = estimate_parameters(cfg.model)
        flops = train_flops_per_sample(cfg.model) * cfg.train.global_batch
        name = torch.cuda.get_device_name(0) if cuda else "cpu"
        peak = peak_tflops(name)
        est = estimate_memory(cfg, params)
        tensors = sum(v for k, v in est.parts.items() if k != "runtime")
        out = {
            "gpu": name, "params": params, "deterministic": cfg.train.deterministic, "compile": cfg.train.compile,
            "micro_batch": cfg.micro_batch, "global_batch": cfg.train.global_batch, "step_s": step_s,
            "samples_per_s": cfg.train.global_batch / step_s, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / (peak * 1e12) if peak else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "estimate_gb": tensors / 1e9, "first_step_s": times[0], "build_s": built_s,
            "step_times_s": times, "profile": profile,
        }  # fmt: skip
        return out
    finally:
        trainer.progress.close()  # the rest is left to the process's exit (see main)


# ---- the matrix --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=None, help="summary.json and profiles.json go here (required)"
    )
    ap.add_argument("--budget-s", type=float, default=400, help="for the whole matrix")
    ap.add_argument("--cpu", action="store_true", help="the code path on the CPU with a tiny model")
    ap.add_argument("--only", default="", help="comma-separated parts of configuration names to run")
    ap.add_argument(
        "--limit-s", type=float, default=100, help="one eager configuration's limit (compiled: 1.5x)"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every configuration",
    )
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one configuration
    ap.add_argument(
        "--smoke", action="store_true", help="--cpu: the code path in seconds (make test runs it)"
    )
    args = ap.parse_args()
    args.cpu = args.cpu or args.smoke
    if args.one is not None:
        # The child ends with os._exit either way: a failed step must not leave it waiting in a
        # teardown (a process group, loader workers) while the matrix's budget runs out.
        try:
            print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        except BaseException as e:
            import traceback

            traceback.print_exc()
            print(f"ERROR {type(e).__name__}: {e}"[:2000], flush=True)
            sys.stderr.flush()
            os._exit(1)
        sys.stderr.flush()
        os._exit(0)
    if args.out is None:
        ap.error("--out is required")
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    matrix = CPU_MATRIX if args.cpu else MATRIX
    wanted = [w for w in args.only.split(",") if w]
    matrix = [m for m in matrix if not wanted or any(w in m[0] for w in wanted)]
    gpu_bytes = 0
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device visible: run with --cpu for the CPU path")
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    summary: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    env = {**os.environ}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    with tempfile.TemporaryDirectory(dir=os.environ.get("WORK")) as tmp:
        root = Path(tmp)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))  # shared: later compiles hit it
        data: dict[str, Path] = {}
        for name, size, det, comp, micro, batch, profile in matrix:
            left = args.budget_s - (time.monotonic() - start)
            if left < 20:
                summary.append({"name": name, "skipped": f"{left:.0f} s of the budget left"})
                continue
            if size not in data:
                from hpclaunch.config import load_config
                from hpclaunch.shards import synth_dataset

                data[size] = root / f"data-{size}"
                cfg = load_config(None, [*SIZE_SETS[size], f"scheduler.gpus_per_node={0 if args.cpu else 1}"])
                synth_dataset(
                    data[size], samples=512 if args.cpu else 1024, seed=0, model_cfg=cfg.model, shard_size=256
                )
            if micro is None:
                micro = suggested_micro_batch(size, det, gpu_bytes)
            spec = {
                "size": size, "deterministic": det, "compile": comp, "micro_batch": micro,
                "global_batch": batch or micro, "profile": profile, "warmup": args.warmup, "steps": args.steps,
                "data": str(data[size]), "run": str(root / name), "overrides": args.overrides,
            }  # fmt: skip
            t0 = time.monotonic()
            row: dict[str, Any] = {"name": name}
            limit = min(left, args.limit_s * (1.5 if comp else 1.0))  # one configuration never takes all
            try:
                proc = subprocess.run(
                    [sys.executable, __file__, "--one", json.dumps(spec)],
                    capture_output=True, text=True, timeout=limit, env=env,
                )  # fmt: skip
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                errors = [x for x in proc.stdout.splitlines() if x.startswith("ERROR ")]
                if proc.returncode == 0 and lines:
                    row.update(json.loads(lines[-1].removeprefix("RESULT ")))
                else:
                    why = (
                        errors[-1].removeprefix("ERROR ") if errors else (proc.stderr or proc.stdout)[-1500:]
                    )
                    row["error"] = f"exit {proc.returncode}: {why}"
            except subprocess.TimeoutExpired:
                row["error"] = f"no result within its limit of {limit:.0f} s"
            row["seconds"] = time.monotonic() - t0
            if row.get("profile"):
                profiles[name] = row.pop("profile")
            row.pop("profile", None)
            summary.append(row)
            print(describe(row), flush=True)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            (args.out / "profiles.json").write_text(json.dumps(profiles, indent=2) + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def describe(row: dict[str, Any]) -> str:
    if "error" in row or "skipped" in row:
        return f"{row['name']}: {row.get('error') or 'skipped, ' + row['skipped']}"
    mfu = f"MFU {row['mfu']:.1%}" if row["mfu"] is not None else "MFU n/a"
    mem = (
        f", peak {row['peak_memory_gb']:.1f} GB (estimate {row['estimate_gb']:.1f})"
        if row["peak_memory_gb"]
        else ""
    )
    return (
        f"{row['name']}: micro-batch {row['micro_batch']} of {row['global_batch']}, step {row['step_s'] * 1000:.1f} ms, "
        f"{row['samples_per_s']:.1f} samples/s, {row['tflops']:.1f} TFLOP/s, {mfu}{mem}; first step "
        f"{row['first_step_s']:.1f} s, built in {row['build_s']:.1f} s ({row['seconds']:.0f} s in all)"
    )


if __name__ == "__main__":
    main()
