"""The training loop torchrun starts on every rank: ``python -m hpclaunch.trainer RUN_DIR``.

Reads ``RUN_DIR/config.yaml``; optional environment ``HPCLAUNCH_ATTEMPT`` (default "local") and
``HPCLAUNCH_JOB_END_TIME`` (epoch seconds; absent = no deadline). Runs under torchrun (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_* set) or as a single process (world size 1, no process group).

What happens, top to bottom (``Trainer.run``):

1. set-up: process group (NCCL on GPUs, gloo on CPU; a separate gloo group for the stop protocol
   on NCCL), deterministic kernels, the distributed smoke test, data (rank 0 validates every
   shard and broadcasts the result), model (a pure function of the seed), DDP, AdamW;
2. resume: the newest valid checkpoint, if any (``Trainer.resume``); rank 0 appends ``resumed``;
3. steps: ``grad_accum`` micro-batches (DDP ``no_sync`` on all but the last), global grad norm,
   the NaN guard, clipping, the optimizer step; metrics; the stop check after every step (but
   the last: a run that has done all its steps is finished); periodic non-blocking saves every
   ``checkpoint.every_steps`` (a step that stops saves once, blocking);
4. the end: finished (all steps done), stopped (a stop cause; blocking save, ``stopped`` event),
   or failed (``train.max_nonfinite_skips`` consecutive non-finite steps, or an error). Rank 0
   writes ``RUN/attempts/<attempt>.json``; every rank exits 0 unless the run failed.

NaN guard. A non-finite loss multiplies the backward by NaN, so its gradients are non-finite;
DDP all-reduces the gradients, so the global grad norm is non-finite on every rank whenever any
rank's loss or gradient was. Deciding on that norm makes the skip identical on all ranks with no
extra collective. A skipped step leaves parameters and optimizer state untouched but still counts
as a step: the step counter and the data position advance (the batch is dropped), so the run keeps
its length and the sample <-> step mapping stays the same as in a run without the fault. Reading
the norm is one scalar host sync per step (as GradScaler does); everything else that is logged
stays on the device until a log step. Saves check that every parameter is finite first, so a
non-finite value never reaches a checkpoint.

Determinism: the learning rate is a pure function of the step, every random draw a pure function
of (seed, step, sample position) (see ``objective``), the data position is one integer
(``samples_consumed``). Nothing else carries state from one step to the next except the model and
the optimizer, which the checkpoint holds.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import sys
import time
import traceback
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig, TrainConfig
from ..errors import DataError, HpclaunchError, TrainingError, debug_enabled
from ..jobs.stop import StopCause, StopController
from ..rundir import RESUMED, STOPPED, AttemptOutcome, Ledger, RunPaths, read_config, write_outcome
from ..rundir.env import ATTEMPT_VAR, END_TIME_VAR, JOIN_STDERR_VAR
from ..rundir.outcome import Status
from ..shards import DatasetInfo, validate_dataset
from .checkpoint import RANK_LOCAL, Checkpointer, rank_local_key
from .data import SampleOrder, ShardedDataset
from .dist import set_deterministic, setup_distributed
from .metrics import MetricsLog, MetricsWindow
from .model import build_model
from .objective import compute_losses, draw
from .progress import Progress, register_stack_dump
from .smoke import run_distributed_smoke

# ---- small pure pieces ---------------------------------------------------------------------------


def lr_at(step: int, t: TrainConfig) -> float:
    """LR of optimizer step ``step`` (1-based): linear warmup, then cosine to ``min_lr_ratio * lr``."""
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    low = t.lr * t.min_lr_ratio
    return low + (t.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def params_sha256(model: nn.Module) -> str:
    """sha256 over the model's state dict (names, dtypes, shapes, bytes), in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def params_finite(model: nn.Module) -> bool:
    flags = [torch.isfinite(p.detach()).all() for p in model.parameters()]
    return bool(torch.stack(flags).all().item()) if flags else True


def init_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state eagerly, exactly as its first step would (step 0, zero moments).

    DCP's ``get_state_dict`` otherwise initialises it by running a zero-lr step, which would move
    Adam's step count by one in runs that save or resume but not in runs that never do; eager
    state keeps every run on the same arithmetic and gives ``load`` tensors to fill in place.
    """
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---- the trainer ---------------------------------------------------------------------------------


@dataclass
class Counters:
    step: int = 0  # optimizer steps completed (skipped ones included)
    samples_consumed: int = 0  # global data position
    nonfinite_consecutive: int = 0
    skipped_total: int = 0


class Trainer:
    """One rank's trainer. ``Trainer(cfg, paths, ...).run()`` -> Outcome (raises on failure)."""

    def __init__(
        self,
        cfg: RunConfig,
        paths: RunPaths,
        *,
        attempt: str = "local",
        end_time: float | None = None,
        checkpoints: bool = True,
        echo: bool = True,
        tty: bool | None = None,
    ):
        self.cfg = cfg
        self.paths = paths
        self.attempt = attempt
        self.end_time = end_time
        self.counters = Counters()
        self.ctx = setup_distributed(cfg)
        # What this rank is doing, for the node agent's watchdog (no collective, no sync).
        self.progress = Progress.for_rank(
            cfg, paths, attempt, self.ctx.rank, device_type=self.ctx.device.type, enabled=checkpoints
        ).start()
        # Handlers first: a stop signalled during set-up (data check, resume) is kept and honoured
        # after the first step instead of killing the rank with no outcome.
        self.stop = StopController(
            stop_file=paths.stop_file,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            group=self.ctx.cpu_group,
            end_time=end_time,
            stop_lead_s=cfg.launch.stop_lead_s,
            margin_s=cfg.launch.stop_margin_s,
        )
        self.stop.install_signal_handlers()
        try:
            self._build(checkpoints)
        except BaseException:
            self.stop.restore_signal_handlers()
            self.progress.close()
            raise
        self.echo = echo
        self.tty = tty
        self.log: MetricsLog | None = None
        self.last_lr = 0.0

    def _build(self, checkpoints: bool) -> None:
        cfg, paths = self.cfg, self.paths
        set_deterministic()
        self._smoke()
        t = cfg.train
        self.per_rank = cfg.train.global_batch // self.ctx.world_size
        self.micro = min(cfg.micro_batch, self.per_rank)
        if self.per_rank % self.micro:
            self.micro = self.per_rank  # a resume on another rank count: no accumulation then
        self.accum = self.per_rank // self.micro
        self.inject = set(cfg.testing.inject_nonfinite_at)
        self.ledger = Ledger(paths, role="trainer", attempt=self.attempt) if self.ctx.is_main else None

        self.data_info = self._validated_data()
        self.dataset = ShardedDataset(self.data_info, cfg.model)
        self.order = SampleOrder(self.data_info.num_samples, t.seed)

        self.model = build_model(cfg.model, seed=t.seed).to(self.ctx.device)
        self._freeze_clean_head()
        self.ddp: nn.Module = self.model
        if self.ctx.initialized:
            from torch.nn.parallel import DistributedDataParallel as DDP

            cuda = self.ctx.device.type == "cuda"
            self.ddp = DDP(
                self.model,
                device_ids=[self.ctx.device] if cuda else None,
                # the clean side's last-block branches feed only its (unused) head in l2t/t2l
                find_unused_parameters=t.mode != "joint",
            )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr_at(1, t),
            betas=(t.betas[0], t.betas[1]),
        )
        init_adamw_state(self.opt)
        self.autocast: Any = nullcontext
        bf16 = t.precision == "bf16" or (t.precision == "auto" and self.ctx.device.type == "cuda")
        if bf16:
            self.autocast = lambda: torch.autocast(device_type=self.ctx.device.type, dtype=torch.bfloat16)

        self.checkpointer: Any = None
        if checkpoints:
            c = cfg.checkpoint
            self.checkpointer = Checkpointer(
                paths.checkpoints,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                config_hash=cfg.config_hash(),
                model_hash=cfg.model_hash(),
                keep_last=c.keep_last,
                keep_every=c.keep_every,
                async_save=c.async_save,
                ledger=self.ledger,
            )
        self.window = MetricsWindow(self.ctx.device)

    # ---- set-up helpers -----------------------------------------------------------------------

    def _smoke(self) -> None:
        if self.ctx.initialized and self.cfg.preflight.distributed_smoke:
            run_distributed_smoke(float(self.cfg.preflight.smoke_timeout_s), group=self.ctx.cpu_group)

    def _validated_data(self) -> DatasetInfo:
        """Rank 0 checks every shard; the others get its verdict (no rank trains on bad data)."""
        d = self.cfg.data
        payload: Any = None
        if self.ctx.is_main:
            try:
                payload = validate_dataset(d.token_dir, d.latent_dir, self.cfg.model)
            except DataError as e:
                payload = ("error", e.message, e.where, e.hint)
        if self.ctx.initialized:
            box = [payload]
            dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
            payload = box[0]
        if isinstance(payload, tuple):
            _, message, where, hint = payload
            raise DataError(message, where=where, hint=hint)
        assert isinstance(payload, DatasetInfo)
        return payload

    def _freeze_clean_head(self) -> None:
        mode = self.cfg.train.mode
        if mode == "l2t":
            self.model.latent_head.requires_grad_(False)
        elif mode == "t2l":
            self.model.text_head.requires_grad_(False)

    # ---- checkpoint hooks ---------------------------------------------------------------------

    def app_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (the layout ``checkpoint.Checkpointer`` saves/loads).

        ``model``/``optim``: DCP state dicts (FQN keys, DDP wrapper stripped); ``train``: the loop
        counters as int64 tensors; ``RANK_LOCAL/rank<r>``: this rank's RNG states. The loop draws
        nothing from them (determinism rule); they are kept for code that does (e.g. dropout).
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        c = self.counters
        rank_local: dict[str, Any] = {
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "numpy_rng": _numpy_rng_tensor(),
        }
        if self.ctx.device.type == "cuda":
            rank_local["cuda_rng"] = torch.cuda.get_rng_state(self.ctx.device)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "train": {
                "step": torch.tensor(c.step, dtype=torch.int64),
                "samples_consumed": torch.tensor(c.samples_consumed, dtype=torch.int64),
                "nonfinite_consecutive": torch.tensor(c.nonfinite_consecutive, dtype=torch.int64),
                "skipped_total": torch.tensor(c.skipped_total, dtype=torch.int64),
            },
            RANK_LOCAL: {rank_local_key(self.ctx.rank): rank_local},
        }

    def resume(self) -> None:
        """Load the newest valid checkpoint (if any) before the first step; log ``resumed``."""
        checkpoint_path: str | None = None
        if self.checkpointer is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self.app_state()
            result = self.checkpointer.load_latest(state)
            if result is not None:
                set_state_dict(
                    self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
                tr = state["train"]
                self.counters = Counters(
                    step=int(tr["step"]),
                    samples_consumed=int(tr["samples_consumed"]),
                    nonfinite_consecutive=int(tr["nonfinite_consecutive"]),
                    skipped_total=int(tr["skipped_total"]),
                )
                if self.ctx.rank not in result.ranks_without_rank_local:
                    mine = state[RANK_LOCAL][rank_local_key(self.ctx.rank)]
                    torch.set_rng_state(mine["torch_rng"])
                    random.setstate(_as_python_rng_state(mine["python_rng"]))
                checkpoint_path = str(result.info.path)
        c = self.counters
        if self.ledger is not None:
            self.ledger.append(
                RESUMED,
                step=c.step,
                checkpoint=checkpoint_path,
                world_size=self.ctx.world_size,
                samples_consumed=c.samples_consumed,
            )

    def save(self, *, blocking: bool) -> None:
        """Checkpoint the state after step ``counters.step`` (collective)."""
        if self.checkpointer is None:
            return
        if not params_finite(self.model):  # identical on all ranks: the replicas are identical
            raise TrainingError(
                f"parameters are not finite after step {self.counters.step}; refusing to checkpoint them"
            )
        t0 = time.perf_counter()
        c = self.counters
        self.progress.phase("save")
        self.checkpointer.save(
            c.step,
            self.app_state(),
            blocking=blocking,
            extra={"samples_consumed": c.samples_consumed, "skipped_total": c.skipped_total},
        )
        if blocking:
            self.stop.note_checkpoint_seconds(time.perf_counter() - t0)
        elif self.checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(self.checkpointer.last_save_seconds)

    # ---- one optimizer step -------------------------------------------------------------------

    def train_step(self) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run step ``counters.step + 1``; return (applied, loss, text, latent, grad_norm)."""
        cfg, t, c = self.cfg, self.cfg.train, self.counters
        step = c.step + 1
        self.last_lr = lr_at(step, t)
        for group in self.opt.param_groups:
            group["lr"] = self.last_lr
        dev = self.ctx.device
        sums = torch.zeros(3, device=dev)
        base = c.samples_consumed + self.ctx.rank * self.per_rank
        latent_shape = (cfg.model.latent_len, cfg.model.latent_dim)
        for m in range(self.accum):
            start = base + m * self.micro
            positions = list(range(start, start + self.micro))
            self.progress.phase("data", step)
            ids, lat = self.dataset.get(self.order.indices(start, self.micro))
            d = draw(t.seed, step, positions, cfg.model.text_len, latent_shape)
            tokens = torch.from_numpy(ids).to(dev, non_blocking=True)
            latents = torch.from_numpy(lat).to(dev, non_blocking=True)
            d.t_text, d.t_latent = d.t_text.to(dev), d.t_latent.to(dev)
            d.mask_keys, d.noise = d.mask_keys.to(dev), d.noise.to(dev)
            last = m == self.accum - 1
            sync = nullcontext() if last or self.ddp is self.model else self.ddp.no_sync()  # type: ignore[operator]
            self.progress.phase("compute")
            with sync:
                with self.autocast():
                    losses = compute_losses(
                        self.ddp,
                        tokens,
                        latents,
                        d,
                        mode=t.mode,
                        mask_id=cfg.model.vocab_size,
                        text_weight=t.text_weight,
                        latent_weight=t.latent_weight,
                    )
                loss = losses.total
                if step in self.inject:
                    loss = loss * float("nan")
                # A non-finite loss poisons the gradients (see the module docstring).
                loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
                (loss / self.accum).backward()
            sums += torch.stack([loss.detach(), losses.text, losses.latent]).float()
        sums /= self.accum

        self.progress.phase("collective")  # the grad norm's host sync waits for DDP's all-reduce
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=dev)
        applied = bool(torch.isfinite(norm).item())  # the one host sync of a step
        if applied:
            if t.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, t.grad_clip, norm)
            self.opt.step()
            c.nonfinite_consecutive = 0
        else:
            c.nonfinite_consecutive += 1
            c.skipped_total += 1
        self.opt.zero_grad(set_to_none=True)
        c.step = step
        c.samples_consumed += t.global_batch
        return applied, sums[0], sums[1], sums[2], norm

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> AttemptOutcome:
        t, c = self.cfg.train, self.counters
        try:
            self.progress.phase("load")
            self.resume()
            c = self.counters
            if self.ctx.is_main:
                self.log = MetricsLog(
                    self.paths.metrics,
                    total_steps=t.steps,
                    start_step=c.step,
                    tty=self.tty,
                    echo=self.echo,
                    attempt=self.attempt,
                )
            cause = StopCause.NONE
            while c.step < t.steps:
                t0 = time.perf_counter()
                applied, loss, text, latent, norm = self.train_step()
                if self.cfg.testing.step_sleep_s:
                    time.sleep(self.cfg.testing.step_sleep_s)
                dt = time.perf_counter() - t0
                self.progress.stepped(c.step, dt)
                self.window.add(loss, text, latent, norm, ok=applied, step_time_s=dt)
                failing = c.nonfinite_consecutive >= t.max_nonfinite_skips
                if c.step % t.log_every == 0 or c.step == t.steps or failing:
                    self.log_window()
                if failing:
                    raise TrainingError(
                        f"{c.nonfinite_consecutive} consecutive non-finite steps (the last at step {c.step}); "
                        f"train.max_nonfinite_skips is {t.max_nonfinite_skips}",
                        hint="lower train.lr, check the data, or raise train.max_nonfinite_skips",
                    )
                if c.step < t.steps:
                    self.progress.phase("collective")
                    cause = self.stop.check(c.step, dt)
                    if cause != StopCause.NONE:
                        if self.window.steps:
                            self.log_window()
                        break
                    if c.step % self.cfg.checkpoint.every_steps == 0:
                        self.save(blocking=False)
            self.save(blocking=True)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if cause != StopCause.NONE and c.step < t.steps:
                if self.ledger is not None:
                    self.ledger.append(STOPPED, cause=cause.label, step=c.step)
                return self.outcome("stopped", cause.label)
            return self.outcome("finished", None)
        finally:
            self.stop.restore_signal_handlers()

    def log_window(self) -> None:
        cfg, c = self.cfg, self.counters
        reduce = (lambda x: dist.all_reduce(x)) if self.ctx.initialized else None
        rec = self.window.collect(reduce, self.ctx.world_size)
        if self.log is None:
            return
        st = rec["step_time_s"]
        sps = cfg.train.global_batch / st if st else None
        rec.update(
            step=c.step,
            lr=self.last_lr,
            samples_per_s=sps,
            tokens_per_s=sps * (cfg.model.text_len + cfg.model.latent_len) if sps else None,
            skipped=c.skipped_total,
        )
        self.log.write(rec)

    def rank_summary(self) -> dict[str, Any]:
        c = self.counters
        return {
            "rank": self.ctx.rank,
            "step": c.step,
            "samples_consumed": c.samples_consumed,
            "skipped": c.skipped_total,
            "params_sha256": params_sha256(self.model),
            "params_finite": params_finite(self.model),
        }

    def gather_summaries(self) -> list[dict[str, Any]]:
        """Every rank's counters and parameter hash (collective; the replicas must agree)."""
        mine = self.rank_summary()
        if not self.ctx.initialized:
            return [mine]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, mine, group=self.ctx.cpu_group)
        return out

    def outcome(self, status: Status, cause: str | None, error: str | None = None) -> AttemptOutcome:
        ranks = self.gather_summaries()
        c = self.counters
        return AttemptOutcome(
            status=status,
            cause=cause,
            step=c.step,
            error=error,
            world_size=self.ctx.world_size,
            extra={
                "attempt": self.attempt,
                "samples_consumed": c.samples_consumed,
                "skipped": c.skipped_total,
                "params_sha256": ranks[0]["params_sha256"],
                "ranks": ranks,
            },
        )

    def close(self) -> None:
        self.progress.close()
        self.stop.restore_signal_handlers()
        if self.log is not None:
            self.log.close()
        if self.checkpointer is not None:
            self.checkpointer.close()


def _numpy_rng_tensor() -> torch.Tensor:
    """numpy's legacy global MT19937 key as a tensor (checkpoints load with weights_only=True)."""
    state: Any = np.random.get_state(legacy=True)
    return torch.from_numpy(np.asarray(state[1], dtype=np.int64))


def _as_python_rng_state(value: Any) -> Any:
    """``random.setstate`` wants (int, tuple, None|float); a checkpoint round trip may give lists."""
    version, internal, gauss = value
    return (int(version), tuple(int(x) for x in internal), gauss)


# ---- the entry point -----------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    if isinstance(err, HpclaunchError):
        return err.one_line()
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0] if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """``python -m hpclaunch.trainer RUN_DIR``: train, write the outcome, return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m hpclaunch.trainer RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0]).resolve()
    if os.environ.get(JOIN_STDERR_VAR) == "1":
        # Under the node agent: this rank's stderr joins its stdout, so the agent can keep torchrun's
        # own stderr (its failure report) apart from what the ranks print.
        os.dup2(1, 2)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before anything touches cuBLAS
    attempt = os.environ.get(ATTEMPT_VAR) or "local"
    end_time = float(os.environ[END_TIME_VAR]) if os.environ.get(END_TIME_VAR) else None
    rank = int(os.environ.get("RANK", 0))
    paths = RunPaths(run_dir)
    trainer: Trainer | None = None
    try:
        cfg = read_config(paths)
        paths = RunPaths.of(run_dir, cfg.checkpoint.dir)
        register_stack_dump(cfg, paths, attempt, rank)  # before the process group: start-up hangs too
        trainer = Trainer(cfg, paths, attempt=attempt, end_time=end_time)
        outcome = trainer.run()
        code = 0
    except (Exception, KeyboardInterrupt) as err:
        # Errors every rank raises together (the NaN guard's verdict, rank 0's data verdict) are
        # reported by rank 0 alone; any other error by the rank that hit it.
        collective = isinstance(err, (TrainingError, DataError)) and trainer is not None
        collective = collective or (isinstance(err, DataError) and trainer is None)
        if rank == 0 or not collective:
            print(f"hpclaunch: training failed: {_one_line(err)}", file=sys.stderr, flush=True)
            if debug_enabled():
                traceback.print_exc()
        step = trainer.counters.step if trainer is not None else 0
        world = trainer.ctx.world_size if trainer is not None else int(os.environ.get("WORLD_SIZE", 1))
        # "data" / "training": the run's own verdict (bad data; non-finite steps, an incompatible
        # checkpoint) that a retry would repeat; "crash": anything else (a network error, a bug),
        # which the node agent may retry within scheduler.max_failure_retries.
        cause = (
            "data"
            if isinstance(err, DataError)
            else "training"
            if isinstance(err, HpclaunchError)
            else "crash"
        )
        outcome = AttemptOutcome("failed", cause, step, _one_line(err), world)
        if isinstance(err, TrainingError) and trainer is not None:
            with suppress(Exception):  # best effort: the failure itself is what matters
                outcome = trainer.outcome("failed", cause, _one_line(err))
        code = err.exit_code if isinstance(err, HpclaunchError) else 1
        if not collective:
            _write_outcome(paths, attempt, outcome, rank)
            return code
    finally:
        if trainer is not None:
            try:
                trainer.close()
            except Exception as e:  # pragma: no cover - a failing close must not hide the outcome
                print(f"hpclaunch: closing the trainer failed: {_one_line(e)}", file=sys.stderr)
    _write_outcome(paths, attempt, outcome, rank)
    if dist.is_available() and dist.is_initialized():
        # Rank 0 has written the outcome before any rank exits (torchrun stops the others as soon
        # as one exits non-zero).
        dist.barrier(group=trainer.ctx.cpu_group if trainer else None)
        dist.destroy_process_group()
    return code


def _write_outcome(paths: RunPaths, attempt: str, outcome: AttemptOutcome, rank: int) -> None:
    if rank == 0:
        write_outcome(paths, attempt, outcome)
