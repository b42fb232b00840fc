"""The training loop every rank runs (``python -m hpclaunch.trainer RUN_DIR``, see ``entry``).

What happens, top to bottom (``Trainer.run``):

1. set-up: process group (NCCL on GPUs, gloo on CPU; a separate gloo group for host-side
   collectives on NCCL), deterministic kernels, the distributed smoke test, data (rank 0 validates
   the shards and broadcasts the result), the model (a pure function of the seed) wrapped for DDP
   or FSDP2 (``dist.wrap_model``), AdamW, the EMA of the weights and the validation set when
   configured;
2. resume: the newest valid checkpoint, if any (``Trainer.resume``); rank 0 appends ``resumed``
   with how long start-up took (``startup``);
3. steps: one DataLoader item per step (``loader``: workers read, draw and pin ahead), ``grad_accum``
   micro-batches (DDP ``no_sync`` on all but the last), global grad norm, the NaN guard, clipping,
   the optimizer step, the EMA; metrics (``metrics.jsonl``, TensorBoard); validation every
   ``train.eval_every`` steps; a failed background save is acted on at the next step; the stop
   check after every step (but the last: a run that has done all its steps is finished);
   periodic non-blocking saves when ``checkpoint.interval.SaveSchedule`` says (every
   ``checkpoint.every_steps``, every ``checkpoint.every_minutes``, or at the interval that loses
   the least expected time: ``every_steps: auto``; a step that stops saves once, blocking);
4. the end: finished (all steps done), stopped (a stop cause; blocking save, ``stopped`` event),
   or failed (``train.max_nonfinite_skips`` consecutive non-finite steps, or an error).

NaN guard. A non-finite loss multiplies the backward by NaN, so its gradients are non-finite;
DDP all-reduces and FSDP reduce-scatters the gradients, so the global grad norm is non-finite on
every rank whenever any rank's loss or gradient was. Deciding on that norm makes the skip
identical on all ranks with no extra collective. A skipped step leaves parameters, optimizer state
and EMA untouched but still counts as a step: the step counter and the data position advance (the
batch is dropped), so the run keeps its length and the sample <-> step mapping stays the same as in
a run without the fault. Reading the norm is one scalar host sync per step; everything else that
is logged stays on the device until a log step. Saves check that every parameter is finite first.

Determinism: the learning rate is a pure function of the step, every random draw a pure function
of (seed, step, sample position) (see ``objective``), the data position is one integer
(``samples_consumed``). Nothing else carries state from one step to the next except the model, the
optimizer and the EMA, which the checkpoint holds.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from ..config import RunConfig, TrainConfig
from ..errors import CheckpointError, TrainingError
from ..jobs.stop import StopController
from ..rundir import (
    CHECKPOINT_FAILED,
    EXPERIMENT_LOG_FAILED,
    RESUMED,
    STOPPED,
    AttemptOutcome,
    Ledger,
    RunPaths,
)
from ..rundir.cause import Cause
from ..rundir.clock import AttemptClock
from ..rundir.outcome import Status
from .build import build_model_parts, load_data, make_checkpointer, make_memory_tier
from .checkpoint import RANK_LOCAL, rank_local_key
from .counters import Counters
from .dist import all_gather_json, close_distributed, reshard, set_deterministic, setup_distributed
from .evaluate import Evaluator
from .explog import ExperimentLogs, open_experiment_logs
from .loader import StepBatches, StepPlan, make_loader, micro_batches, raise_data_problem
from .memory_tier import TierFields
from .metrics import MetricsLog, MetricsWindow, max_memory_gb
from .objective import compute_losses
from .periodic_saves import PeriodicSaves
from .progress import Progress
from .smoke import run_distributed_smoke
from .startup import StartupClock
from .state import params_finite, params_sha256, restore_rng_state, rng_state, state_digests
from .state_cache import CachedStateDicts

__all__ = ["Counters", "Trainer", "lr_at", "params_sha256"]


def lr_at(step: int, t: TrainConfig) -> float:
    """LR of optimizer step ``step`` (1-based): linear warmup, then cosine to ``min_lr_ratio * lr``."""
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    low = t.lr * t.min_lr_ratio
    return low + (t.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Trainer:
    """One rank's trainer. ``Trainer(cfg, paths, ...).run()`` -> Outcome (raises on failure)."""

    def __init__(
        self,
        cfg: RunConfig,
        paths: RunPaths,
        *,
        attempt: str = "local",
        clock: AttemptClock | None = None,
        checkpoints: bool = True,
        echo: bool = True,
        tty: bool | None = None,
        startup: StartupClock | None = None,
    ):
        self.cfg = cfg
        self.paths = paths
        self.attempt = attempt
        self.clock = clock  # the attempt's time (rundir.clock); None: no deadline
        self._buckets_settled = False  # DDP: see settle_ddp_buckets
        self.counters = Counters()
        self.startup = startup or StartupClock()
        self.startup.begin()
        self.ctx = setup_distributed(cfg)
        self.startup.mark("distributed")
        # What this rank is doing, for the node agent's watchdog (no collective, no sync).
        self.progress = Progress.for_rank(
            cfg, paths, attempt, self.ctx.rank, device_type=self.ctx.device.type, enabled=checkpoints
        ).start()
        # Handlers first: a stop signalled during set-up (data check, resume) is kept and honoured
        # after the first step instead of killing the rank with no outcome.
        self.stop = StopController(
            paths=paths,
            attempt=attempt,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            group=self.ctx.cpu_group,
            clock=clock,
        )
        self.stop.install_signal_handlers()
        self.echo, self.tty = echo, tty
        self.log: MetricsLog | None = None
        self.tb: ExperimentLogs | None = None
        self.initialized: Any = None  # where the first weights came from (train.init_from), if not the seed
        self.last_lr = 0.0
        try:
            self._build(checkpoints)
        except BaseException:
            self.stop.restore_signal_handlers()
            self.progress.close()
            close_distributed(self.ctx)
            raise

    def _build(self, checkpoints: bool) -> None:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        set_deterministic(compile=t.compile)
        if ctx.world_size > 1 and cfg.preflight.distributed_smoke:
            run_distributed_smoke(float(cfg.preflight.smoke_timeout_s), group=ctx.cpu_group)
        self.startup.mark("smoke")
        self.per_rank = t.global_batch // ctx.world_size
        self.micro = min(cfg.micro_batch, self.per_rank)
        if self.per_rank % self.micro:
            self.micro = self.per_rank  # a resume on another rank count: no accumulation then
        self.accum = self.per_rank // self.micro
        self.inject = set(cfg.testing.inject_nonfinite_at)
        self.ledger = Ledger(self.paths, role="trainer", attempt=self.attempt) if ctx.is_main else None
        self.data = load_data(cfg, ctx, self.paths.root if checkpoints else None)
        self.startup.mark("data")

        p = build_model_parts(cfg, ctx, lr=lr_at(1, t))
        self.model, self.train_module, self.opt, self.ema = p.model, p.train_module, p.opt, p.ema  # fmt: skip
        self.params, self.autocast, self.sharded = p.params, p.autocast, p.sharded
        self.evaluator: Evaluator | None = None
        if t.eval_every and self.data.val is not None and self.data.val_indices is not None:
            self.evaluator = Evaluator(
                cfg, self.data.val, self.data.val_indices, rank=ctx.rank, world=ctx.world_size,
                batch=self.micro, device=ctx.device,
            )  # fmt: skip
        self.checkpointer = make_checkpointer(cfg, ctx, self.paths, self.ledger) if checkpoints else None
        self.memory = make_memory_tier(cfg, ctx, self.paths, self.ledger) if checkpoints else None
        self._state_dicts: CachedStateDicts | None = None  # the memory tier's, made at its first snapshot
        self.window = MetricsWindow(ctx.device)
        self.startup.mark("model")

    # ---- checkpoint hooks ---------------------------------------------------------------------

    def app_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (the layout ``checkpoint.Checkpointer`` saves/loads).

        ``model``/``optim``: DCP state dicts (FQN keys, wrappers stripped; DTensor shards under
        FSDP, so DCP reshards on load to any world size and between DDP and FSDP); ``ema``: the
        average's shadow weights (sharded like the model) and update count; ``train``: the loop
        counters as int64 tensors; ``RANK_LOCAL/rank<r>``: this rank's RNG states. The loop draws
        nothing from them (determinism rule); they are kept for code that does (e.g. dropout).
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return self._state_with(*get_state_dict(self.model, self.opt))

    def snapshot_state(self) -> dict[str, Any]:
        """``app_state`` for the memory tier: the model's and optimizer's state dicts are made once
        and reused (``state_cache``: the same live tensors, hyperparameters refreshed)."""
        if self._state_dicts is None:
            self._state_dicts = CachedStateDicts(self.model, self.opt)
        return self._state_with(*self._state_dicts.get())

    def _state_with(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> dict[str, Any]:
        c = self.counters
        state: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "train": {k: torch.tensor(v, dtype=torch.int64) for k, v in asdict(c).items()},
            RANK_LOCAL: {rank_local_key(self.ctx.rank): rng_state(self.ctx.device)},
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def resume(self) -> None:
        """Load the newest valid checkpoint (if any) before the first step; log ``resumed``."""
        checkpoint_path: str | None = None
        tier: TierFields = {}  # with the memory tier: which one, and the disk's step beside it
        if self.checkpointer is not None:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self.app_state()
            restored = None
            if self.memory is not None:
                restored, tier = self.memory.restore(
                    state, self.checkpointer.directory, self.ctx.host_group()
                )
            result = None if restored is not None else self.checkpointer.load_latest(state)
            loaded = restored or result  # (the memory's snapshot, or the disk's checkpoint)
            if loaded is not None:
                sections = loaded.saved_sections
                set_state_dict(
                    self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
                self.counters.load(state["train"])
                if self.ema is not None and "ema" in sections:
                    self.ema.load_counts(state["ema"])
                elif self.ema is not None:  # turned on after this checkpoint was written
                    self.ema.reset_from_model()
                if self.ctx.rank not in loaded.ranks_without_rank_local:
                    restore_rng_state(state[RANK_LOCAL][rank_local_key(self.ctx.rank)], self.ctx.device)
                checkpoint_path = (
                    restored.path if restored is not None else str(result.info.path) if result else None
                )
                if self.memory is not None:
                    tier.setdefault("tier", "disk")
            elif self.cfg.train.init_from:  # no checkpoint of its own yet: another run's weights
                from .init_from import init_weights

                self.initialized = init_weights(self.cfg, self.ctx, self.model, self.ema, self.ledger)
        self.startup.mark("load")
        c = self.counters
        if self.ledger is not None:
            self.ledger.append(
                RESUMED,
                step=c.step,
                checkpoint=checkpoint_path,
                world_size=self.ctx.world_size,
                samples_consumed=c.samples_consumed,
                parallel=self.cfg.train.parallel,
                token_shards_checked=self.data.checked_shards,
                process_start=round(self.startup.process_start, 3),
                startup_s=self.startup.seconds(),
                **tier,
            )

    def save(self, *, blocking: bool, supersede: bool = False) -> None:
        """Checkpoint the state after step ``counters.step`` (collective). ``supersede``: a stop's
        save; a background save still writing is dropped rather than waited for (this step is
        newer, and the deadline keeps no room for a writer starved of CPU or still starting)."""
        if self.checkpointer is None:
            return
        try:
            # the previous background save, should it have failed unseen
            self.checkpointer.wait(supersede=supersede)
        except CheckpointError as error:
            return self._save_again_after(error)
        if not params_finite(self.model, sharded=self.sharded):
            raise TrainingError(
                f"parameters are not finite after step {self.counters.step}; refusing to checkpoint them"
            )
        t0 = time.perf_counter()
        c = self.counters
        self.progress.phase("save")
        self.checkpointer.save(c.step, self.app_state(), blocking=blocking, extra=self.save_extra())
        if blocking:
            self.stop.note_checkpoint_seconds(time.perf_counter() - t0)
        elif self.checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(self.checkpointer.last_save_seconds)

    def save_extra(self) -> dict[str, Any]:
        """What a checkpoint's manifest says beside the state."""
        c = self.counters
        return {
            "samples_consumed": c.samples_consumed,
            "skipped_total": c.skipped_total,
            "parallel": self.cfg.train.parallel,
            "ema": self.ema is not None,
            "model": self.cfg.model.model_dump(mode="json"),  # names what differs on a refusal
        }

    def act_on_failed_background_save(self) -> None:
        """A background save that failed is saved again now, blocking; if that fails too, the run
        stops with the reason (collective while a background save is pending). One that settled
        is a measured save for the deadline's lead from this step on: without it an attempt whose
        only save so far ran in the background stops with the plan's estimate, which a loaded
        machine outruns (the PBS walltime test saved 0.3 s past the walltime that way)."""
        if self.checkpointer is None:
            return
        settled = self.checkpointer.settled_saves
        error = self.checkpointer.poll_background(self.ctx.host_group())
        if error is not None:
            self._save_again_after(error)
        elif self.checkpointer.settled_saves != settled and self.checkpointer.last_save_seconds is not None:
            self.stop.note_checkpoint_seconds(self.checkpointer.last_save_seconds)

    def _experiment_log_failed(self, log: str, error: str, action: str) -> None:
        """W&B or TensorBoard failed: said once (console and ledger, for status); training goes on."""
        if self.ledger is not None:
            self.ledger.append(
                EXPERIMENT_LOG_FAILED, step=self.counters.step, log=log, error=error, action=action
            )
        text = f"warning: {log}: {error}; {action}"
        if self.log is not None:
            self.log.message(text)
        else:
            print(text, flush=True)

    def _save_again_after(self, error: CheckpointError) -> None:
        step = self.counters.step
        if self.ledger is not None:
            self.ledger.append(CHECKPOINT_FAILED, step=step, error=error.one_line(), action="blocking retry")
        if self.log is not None:
            self.log.message(f"background checkpoint failed ({error.one_line()}); saving step {step} now")
        try:
            self.save(blocking=True)
        except CheckpointError as again:
            raise CheckpointError(
                f"checkpoint failed twice (background, then a blocking retry at step {step}): "
                f"{again.message}",
                where=again.where,
                hint=again.hint
                or "fix the checkpoint directory, then resume: the last good checkpoint is kept",
            ) from again

    # ---- one optimizer step -------------------------------------------------------------------

    def step_batches(self) -> StepBatches:
        """This rank's items from the current step to the end of the run."""
        cfg, c = self.cfg, self.counters
        plan = StepPlan(
            seed=cfg.train.seed, first_step=c.step + 1, first_position=c.samples_consumed,
            steps=max(0, cfg.train.steps - c.step), global_batch=cfg.train.global_batch,
            rank=self.ctx.rank, per_rank=self.per_rank, micro=self.micro, pad_id=cfg.data.pad_id,
        )  # fmt: skip
        return StepBatches(self.data.train, self.data.order, plan)

    def loader(self) -> Any:
        """The DataLoader over ``step_batches`` (workers prefetch; pinned on CUDA)."""
        d = self.cfg.data
        cuda = self.ctx.device.type == "cuda"
        return make_loader(
            self.step_batches(), num_workers=d.num_workers, prefetch_factor=d.prefetch_factor, pin_memory=cuda
        )

    def settle_ddp_buckets(self, item: dict[str, torch.Tensor]) -> None:
        """One forward and backward pass on the attempt's first item, thrown away (no optimizer
        step, the RNG restored), before its first step.

        DDP buckets the gradients in one order for its first backward pass and rebuilds the buckets
        in the order the gradients became ready, once, at the next forward. Where an element sits
        in its bucket decides the order in which the ring all-reduce sums its ranks' values, and
        with three ranks or more that order changes the rounding. A run that resumed at step 21
        used to reduce step 21 with the first order where the uninterrupted run used the rebuilt
        one, and was no longer bitwise equal to it. With this pass every attempt's first step,
        fresh or resumed, already runs on the rebuilt buckets."""
        self._buckets_settled = True
        if self.train_module is self.model or self.ctx.world_size < 2:
            return
        t, dev = self.cfg.train, self.ctx.device
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if dev.type == "cuda" else None
        mb = micro_batches(item, dev)[0]
        with self.autocast():
            losses = compute_losses(
                self.train_module, mb.tokens, mb.latents, mb.draws, mode=t.mode,
                mask_id=self.cfg.model.vocab_size, text_weight=t.text_weight,
                latent_weight=t.latent_weight, text_mask=mb.text_mask,
            )  # fmt: skip
        losses.total.backward()
        self.opt.zero_grad(set_to_none=True)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    def train_step(
        self, item: dict[str, torch.Tensor] | None = None
    ) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run step ``counters.step + 1`` on its loader item (None: build it here); return
        (applied, loss, text, latent, grad_norm)."""
        cfg, t, c = self.cfg, self.cfg.train, self.counters
        step = c.step + 1
        if item is None:
            item = self.step_batches()[0]
        if int(item["step"]) != step:  # the loader and the counters must never drift apart
            raise TrainingError(f"data loader is at step {int(item['step'])}, the trainer at {step}")
        self.last_lr = lr_at(step, t)
        for group in self.opt.param_groups:
            group["lr"] = self.last_lr
        dev = self.ctx.device
        sums = torch.zeros(3, device=dev)
        batches = micro_batches(item, dev)
        ddp = self.train_module is not self.model
        for m, mb in enumerate(batches):
            last = m == self.accum - 1
            sync = nullcontext() if last or not ddp else self.train_module.no_sync()  # type: ignore[operator]
            self.progress.phase("compute", step)
            with sync:
                with self.autocast():
                    losses = compute_losses(
                        self.train_module, mb.tokens, mb.latents, mb.draws, mode=t.mode,
                        mask_id=cfg.model.vocab_size, text_weight=t.text_weight,
                        latent_weight=t.latent_weight, text_mask=mb.text_mask,
                    )  # fmt: skip
                loss = losses.total
                if step in self.inject:
                    loss = loss * float("nan")
                # A non-finite loss poisons the gradients (see the module docstring).
                loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
                (loss / self.accum).backward()
            sums += torch.stack([loss.detach(), losses.text, losses.latent]).float()
        sums /= self.accum

        self.progress.phase("collective")  # the grad norm's host sync waits for the gradient reduction
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=dev)
        plain_norm = norm.full_tensor() if self.sharded else norm  # type: ignore[attr-defined]
        applied = bool(torch.isfinite(plain_norm).item())  # the one host sync of a step
        if applied:
            if t.grad_clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, t.grad_clip, norm)
            if self.checkpointer is not None:  # CUDA: a save's staging copies finish first (on the GPU)
                self.checkpointer.before_update()
            if self.memory is not None:
                self.memory.before_update()
            self.opt.step()
            if self.ema is not None:
                self.ema.update()
            c.nonfinite_consecutive = 0
        else:
            c.nonfinite_consecutive += 1
            c.skipped_total += 1
        self.opt.zero_grad(set_to_none=True)
        c.step = step
        c.samples_consumed += t.global_batch
        return applied, sums[0], sums[1], sums[2], plain_norm

    def evaluate(self) -> dict[str, float | None]:
        """Validation losses of the current weights (the EMA's when on); collective."""
        assert self.evaluator is not None
        self.progress.phase("eval")
        # The bare model, not the DDP wrapper (no gradient hooks); under FSDP it is the sharded root.
        if self.ema is None:
            return self.evaluator.run(self.model, autocast=self.autocast)
        with self.ema.applied(before=lambda: reshard(self.model)):
            return self.evaluator.run(self.model, autocast=self.autocast)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> AttemptOutcome:
        t = self.cfg.train
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
                if self.checkpointer is not None:  # TensorBoard and/or W&B (``explog``)
                    self.tb = open_experiment_logs(
                        self.cfg,
                        self.paths.root,
                        attempt=self.attempt,
                        resumed_step=c.step,
                        on_failure=self._experiment_log_failed,
                    )
                if self.tb is not None:
                    self.tb.mark("resumed", c.step, self._resume_text())
            cause: Cause | None = None
            saves = PeriodicSaves(
                self.cfg, self.ctx, self.paths, self.ledger, self.attempt, start_step=c.step
            )
            batches: Any = iter(self.loader())
            while c.step < t.steps:
                t0 = time.perf_counter()
                self.progress.phase("data", c.step + 1)
                item = next(batches)
                raise_data_problem(item)
                if not self._buckets_settled:
                    self.settle_ddp_buckets(item)
                applied, loss, text, latent, norm = self.train_step(item)
                if self.cfg.testing.step_sleep_s:
                    time.sleep(self.cfg.testing.step_sleep_s)
                dt = time.perf_counter() - t0
                self.progress.stepped(c.step, dt)
                saves.observe(dt, self.checkpointer)
                self.window.add(loss, text, latent, norm, ok=applied, step_time_s=dt)
                failing = c.nonfinite_consecutive >= t.max_nonfinite_skips
                val = self.evaluate() if t.eval_every and c.step % t.eval_every == 0 else None
                if c.step % t.log_every == 0 or c.step == t.steps or failing or val is not None:
                    self.log_window(val)
                if failing:
                    raise TrainingError(
                        f"{c.nonfinite_consecutive} consecutive non-finite steps (the last at step {c.step}); "
                        f"train.max_nonfinite_skips is {t.max_nonfinite_skips}",
                        hint="lower train.lr, check the data, or raise train.max_nonfinite_skips",
                    )
                self.act_on_failed_background_save()
                saves.after_step(self.checkpointer, c.step)
                if c.step < t.steps:
                    self.progress.phase("collective")
                    cause = self.stop.check(c.step, dt)
                    if cause is not None:
                        if self.window.steps:
                            self.log_window(None)
                        break
                    disk_save_now = saves.due(c.step)
                    if disk_save_now:
                        self.save(blocking=False)
                        saves.started(self.checkpointer, c.step)
                    if self.memory is not None:
                        self.memory.after_step(c.step, self.snapshot_state, disk_save_now=disk_save_now)
            batches = None  # stops the loader's workers before the final save
            lead = self.stop.lead_fields()  # in force at the stop, before its own save is measured
            if self.memory is not None:
                self.memory.drop_pending()
            self.save(blocking=True, supersede=cause is not None)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if self.memory is not None:  # the last save is on disk: the node's memory is freed
                self.memory.close(remove=True)
                self.memory = None
            if cause is not None and c.step < t.steps:
                if self.ledger is not None:
                    # the lead the deadline kept and the save it kept room for (None: planned)
                    self.ledger.append(STOPPED, cause=cause, step=c.step, **lead)
                if self.tb is not None:
                    self.tb.mark("stopped", c.step, f"stopped after step {c.step}: {cause}")
                return self.outcome("stopped", cause)
            if self.tb is not None:
                self.tb.mark("finished", c.step, f"finished at step {c.step}")
            return self.outcome("finished", None)
        finally:
            self.stop.restore_signal_handlers()

    def _resume_text(self) -> str:
        c = self.counters
        start = f"resumed from step {c.step}" if c.step else "started"
        if not c.step and self.initialized is not None:
            start += f" from the {self.initialized.describe()}"
        return f"{start} (attempt {self.attempt}, {self.ctx.world_size} ranks, {self.cfg.train.parallel})"

    def log_window(self, val: dict[str, float | None] | None) -> None:
        cfg, c = self.cfg, self.counters
        reduce = (lambda x: dist.all_reduce(x)) if self.ctx.initialized and self.ctx.world_size > 1 else None
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
            max_memory_gb=max_memory_gb(self.ctx.device),
            **(val or {}),
        )
        self.log.write(rec)
        if self.tb is not None:
            self.tb.scalars(rec)

    # ---- the end ------------------------------------------------------------------------------

    def gather_summaries(self) -> list[dict[str, Any]]:
        """Every rank's counters and digests (collective; DDP replicas must agree)."""
        c = self.counters
        mine = {"rank": self.ctx.rank, "step": c.step, "samples_consumed": c.samples_consumed}
        mine |= {
            "skipped": c.skipped_total,
            **state_digests(self.model, self.opt, self.ema, sharded=self.sharded),
        }
        return list(all_gather_json(mine, self.ctx.host_group()))

    def outcome(self, status: Status, cause: Cause | None, error: str | None = None) -> AttemptOutcome:
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
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        try:
            if self.memory is not None:  # (left for an in-place restart after a failure)
                self.memory.close(remove=False)
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            close_distributed(self.ctx)
