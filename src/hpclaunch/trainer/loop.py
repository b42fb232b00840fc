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
   periodic non-blocking saves when ``checkpoint.save_interval.SaveSchedule`` says (every
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

This module owns the set-up, the state a checkpoint holds (``Trainer.app_state``), one optimizer
step and the loop; its parts are modules of their own: ``counters``, ``step_feed`` (a rank's share
of each step and its items), ``ddp_buckets`` (the pass before an attempt's first step), ``resume``
(a loaded state taken up; ``resumed``), ``saving`` (disk saves and a failed background save) and
``reports`` (the metrics window, the logs, the outcome).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from ..config import RunConfig
from ..errors import TrainingError
from ..jobs.stop import StopController, StopGroup
from ..lr_schedule import lr_at  # the LR rule (a resume's too), shared with submit and status
from ..rundir import AttemptOutcome, Ledger, RunPaths
from ..rundir.cause import Cause
from ..rundir.clock import AttemptClock
from ..rundir.outcome import Status
from .build import build_model_parts, load_data, make_checkpointer, make_memory_tier
from .checkpoint import RANK_LOCAL, rank_local_key
from .compile_cache import CompileCache
from .counters import Counters
from .ddp_buckets import DDPBuckets
from .dist import device_kind, reshard, set_deterministic, setup_distributed
from .evaluate import Evaluator
from .grads import clip_, local_grads, shard_group, total_norm
from .loader import micro_batches, raise_data_problem
from .memory_tier import TierFields
from .periodic_saves import PeriodicSaves
from .profiling import StepProfiler
from .rank_progress import Progress
from .rank_run import RankRun
from .reports import Reports
from .resume import record_resumed, take_up
from .saving import CheckpointSaves
from .smoke import run_distributed_smoke
from .startup import StartupClock
from .state import params_sha256, rng_state, state_digests
from .state_cache import CachedStateDicts
from .step_feed import StepFeed

if TYPE_CHECKING:
    from .init_from import Initialized

__all__ = ["Counters", "Trainer", "lr_at", "params_sha256"]


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
        startup: StartupClock | None = None,
    ):
        self.cfg = cfg
        self.paths = paths
        self.attempt = attempt
        self.clock = clock  # the attempt's time (rundir.clock); None: no deadline
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
            ranks=StopGroup(self.ctx.rank, self.ctx.world_size, self.ctx.cpu_group),
            clock=clock,
        )
        self.stop.install_signal_handlers()
        self.initialized: Initialized | None = None  # where the first weights came from, if not the seed
        self.last_lr = 0.0
        try:
            self._build(checkpoints, echo=echo)
        except BaseException:
            self.stop.restore_signal_handlers()
            self.progress.close()
            raise

    def _build(self, checkpoints: bool, *, echo: bool) -> None:
        cfg, ctx, t = self.cfg, self.ctx, self.cfg.train
        set_deterministic(compile=t.compile, deterministic=t.deterministic)
        self.compile_cache = CompileCache(
            self.paths, enabled=t.compile, rank=ctx.rank, device_kind=device_kind(ctx.device)
        )
        self.compile_cache.prepare()  # before the first compile (the first step's)
        if ctx.world_size > 1 and cfg.preflight.distributed_smoke:
            run_distributed_smoke(float(cfg.preflight.smoke_timeout_s), group=ctx.cpu_group)
        self.startup.mark("smoke")
        self.feed = StepFeed(cfg, ctx, self.counters)
        self.inject = set(cfg.testing.inject_nonfinite_at)
        self.ledger = Ledger(self.paths, role="trainer", attempt=self.attempt) if ctx.is_main else None
        self.data = load_data(cfg, ctx, self.paths.root if checkpoints else None)
        self.startup.mark("data")

        p = build_model_parts(cfg, ctx, lr=lr_at(1, t))
        self.model, self.train_module, self.opt, self.ema = p.model, p.train_module, p.opt, p.ema  # fmt: skip
        self.params, self.autocast, self.sharded = p.params, p.autocast, p.sharded
        self.shard_group = shard_group(self.params)  # the grad norm's all-reduce (None: not needed)
        self.buckets = DDPBuckets(
            cfg, ctx, model=self.model, train_module=self.train_module, opt=self.opt, autocast=self.autocast
        )
        self.evaluator: Evaluator | None = None
        if t.eval_every and self.data.val is not None and self.data.val_indices is not None:
            self.evaluator = Evaluator(
                cfg, self.data.val, self.data.val_indices, rank=ctx.rank, world=ctx.world_size,
                batch=self.feed.micro, device=ctx.device,
            )  # fmt: skip
        self.checkpointer = make_checkpointer(cfg, ctx, self.paths, self.ledger) if checkpoints else None
        self.memory = make_memory_tier(cfg, ctx, self.paths, self.ledger) if checkpoints else None
        self._state_dicts: CachedStateDicts | None = None  # the memory tier's, made at its first snapshot
        self.rank_run = RankRun(cfg, ctx, self.paths, self.attempt, self.ledger, self.counters)
        self.reports = Reports(self.rank_run, echo=echo)
        self.saving = CheckpointSaves(
            self.rank_run, model=self.model, sharded=self.sharded, ema=self.ema is not None,
            stop=self.stop, progress=self.progress, reports=self.reports,
        )  # fmt: skip
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
            state = self.app_state()
            restored = None
            if self.memory is not None:
                restored, tier = self.memory.restore(
                    state, self.checkpointer.directory, self.ctx.host_group()
                )
            result = None if restored is not None else self.checkpointer.load_latest(state)
            loaded = restored or result  # (the memory's snapshot, or the disk's checkpoint)
            if loaded is not None:
                take_up(
                    state, loaded, self.ctx, model=self.model, opt=self.opt, ema=self.ema,
                    counters=self.counters,
                )  # fmt: skip
                checkpoint_path = (
                    restored.path if restored is not None else str(result.info.path) if result else None
                )
                if self.memory is not None:
                    tier.setdefault("tier", "disk")
            elif self.cfg.train.init_from:  # no checkpoint of its own yet: another run's weights
                from .init_from import init_weights

                self.initialized = init_weights(self.cfg, self.ctx, self.model, self.ema, self.ledger)
        self.startup.mark("load")
        if self.ledger is not None:
            record_resumed(
                self.ledger, self.rank_run, checkpoint=checkpoint_path,
                token_shards_checked=self.data.checked_shards, startup=self.startup, tier=tier,
            )  # fmt: skip

    def save(self, *, blocking: bool, supersede: bool = False) -> None:
        """Checkpoint the state after step ``counters.step`` (collective; ``saving``)."""
        if self.checkpointer is not None:
            self.saving.save(self.checkpointer, self.app_state, blocking=blocking, supersede=supersede)

    def act_on_failed_background_save(self) -> None:
        """Save again, blocking, if a background save failed (``saving``); run after every step."""
        if self.checkpointer is not None:
            self.saving.act_on_failed_background_save(self.checkpointer, self.app_state)

    # ---- one optimizer step -------------------------------------------------------------------

    def train_step(
        self, item: dict[str, torch.Tensor] | None = None
    ) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run step ``counters.step + 1`` on its loader item (None: build it here); return
        (applied, loss, text, latent, grad_norm)."""
        cfg, t, c = self.cfg, self.cfg.train, self.counters
        step = c.step + 1
        if item is None:
            item = self.feed.step_batches(self.data)[0]
        # The loader and the counters must never drift apart. The item's step is a host tensor:
        # read as a list it is no op of the step (bench/step_anatomy.py counts the device reads).
        loader_step = item["step"].tolist()
        if loader_step != step:
            raise TrainingError(f"data loader is at step {loader_step}, the trainer at {step}")
        self.last_lr = lr_at(step, t)
        for group in self.opt.param_groups:
            group["lr"] = self.last_lr
        dev = self.ctx.device
        sums = torch.zeros(3, device=dev)
        batches = micro_batches(item, dev)
        accum = self.feed.accum
        ddp = self.train_module is not self.model
        for m, mb in enumerate(batches):
            last = m == accum - 1
            sync = nullcontext() if last or not ddp else self.train_module.no_sync()  # type: ignore[operator]
            self.progress.phase("compute", step)
            with sync:
                with self.autocast():
                    losses = mb.losses(self.train_module, cfg)
                loss = losses.total
                if step in self.inject:
                    loss = loss * float("nan")
                # A non-finite loss poisons the gradients (see the module docstring).
                loss = loss * torch.where(torch.isfinite(loss.detach()), 1.0, float("nan"))
                (loss / accum).backward()
            sums += torch.stack([loss.detach(), losses.text, losses.latent]).float()
        sums /= accum

        self.progress.phase("collective")  # the grad norm's host sync waits for the gradient reduction
        grads = local_grads(self.params)
        norm = total_norm(grads, self.shard_group, dev)
        applied = bool(torch.isfinite(norm).item())  # the one host sync of a step
        if self.memory is not None:  # (every step: a skipped one's evaluation swaps the EMA in)
            self.memory.before_update()
        if applied:
            if t.grad_clip is not None:
                clip_(grads, t.grad_clip, norm)
            if self.checkpointer is not None:  # CUDA: a save's staging copies finish first (on the GPU)
                self.checkpointer.before_update()
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
        return applied, sums[0], sums[1], sums[2], norm

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
            # TensorBoard and/or W&B (``explog``) only for runs that keep checkpoints
            self.reports.open(experiment_logs=self.checkpointer is not None, initialized=self.initialized)
            cause: Cause | None = None
            saves = PeriodicSaves(
                self.cfg, self.ctx, self.paths, self.ledger, self.attempt, start_step=c.step
            )
            batches: Any = iter(self.feed.loader(self.data))
            profiler = StepProfiler(
                t.profile, self.paths.root / "profile", self.ctx.rank, self.ctx.device.type
            )
            while c.step < t.steps:
                profiler.before_step(c.step + 1)
                t0 = time.perf_counter()
                self.progress.phase("data", c.step + 1)
                item = next(batches)
                raise_data_problem(item)
                self.buckets.settle(item)  # every attempt's first step on DDP's rebuilt buckets
                applied, loss, text, latent, norm = self.train_step(item)
                if self.cfg.testing.step_sleep_s:
                    time.sleep(self.cfg.testing.step_sleep_s)
                dt = time.perf_counter() - t0
                profiler.after_step(c.step, dt)
                self.compile_cache.after_step(c.step)
                self.progress.stepped(c.step, dt)
                saves.observe(dt, self.checkpointer)
                self.reports.window.add(loss, text, latent, norm, ok=applied, step_time_s=dt)
                failing = c.nonfinite_consecutive >= t.max_nonfinite_skips
                val = self.evaluate() if t.eval_every and c.step % t.eval_every == 0 else None
                if c.step % t.log_every == 0 or c.step == t.steps or failing or val is not None:
                    self.reports.log_window(val, lr=self.last_lr)
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
                        if self.reports.window.steps:
                            self.reports.log_window(None, lr=self.last_lr)
                        break
                    disk_save_now = saves.due(c.step)
                    if disk_save_now:
                        self.save(blocking=False)
                        saves.started(self.checkpointer, c.step)
                    if self.memory is not None:
                        self.memory.after_step(c.step, self.snapshot_state, disk_save_now=disk_save_now)
            profiler.finish()  # (a stop inside the profiled steps: what it has)
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
                self.reports.stopped(cause, lead)
                return self.outcome("stopped", cause)
            self.reports.finished()
            return self.outcome("finished", None)
        finally:
            self.stop.restore_signal_handlers()

    # ---- the end ------------------------------------------------------------------------------

    def outcome(self, status: Status, cause: Cause | None, error: str | None = None) -> AttemptOutcome:
        """The attempt's outcome with every rank's counters and digests (collective; ``reports``)."""
        digests = state_digests(self.model, self.opt, self.ema, sharded=self.sharded)
        return self.reports.outcome(status, cause, error, digests=digests)

    def close(self) -> None:
        self.progress.close()
        self.stop.restore_signal_handlers()
        self.reports.close()
        if self.memory is not None:  # (left for an in-place restart after a failure)
            self.memory.close(remove=False)
        if self.checkpointer is not None:
            self.checkpointer.close()
