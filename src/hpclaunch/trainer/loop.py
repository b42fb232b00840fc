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
from typing import TYPE_CHECKING, Any

import torch

from ..config import RunConfig
from ..errors import TrainingError
from ..lr_schedule import lr_at  # the LR rule (a resume's too), shared with submit and status
from ..rank import session as sessions
from ..rank.attach import open_run
from ..rank.objects import Attached
from ..rank.run import RunHooks, Stopped
from ..rank.site import RankSite
from ..rank.smoke import run_distributed_smoke
from ..rank.startup import StartupClock
from ..rank.tensors import params_sha256
from ..rank.testing_knobs import step_sleep_s
from ..rundir import AttemptOutcome, RunPaths
from ..rundir.cause import Cause
from ..rundir.clock import AttemptClock
from ..rundir.outcome import Status
from .counters import Counters
from .data.loader import micro_batches, raise_data_problem
from .data.step_feed import StepFeed
from .evaluate import Evaluator
from .grads import clip_, local_grads, shard_group, total_norm
from .rank_run import RankRun
from .reporting.profiling import StepProfiler
from .reporting.reports import Reports
from .setup.build import build_model_parts, load_data
from .setup.compile_cache import CompileCache
from .setup.ddp_buckets import DDPBuckets
from .setup.parallel import device_kind, reshard, set_deterministic, setup_distributed
from .state import state_digests

if TYPE_CHECKING:
    from .model.init_from import Initialized

__all__ = ["Counters", "Trainer", "lr_at", "params_sha256"]


class Trainer:
    """One rank's trainer. ``Trainer(cfg, paths, ...).run()`` -> Outcome (raises on failure).

    Built on the rank package's run (``rank.attach.open_run``), as a user's script is: the run owns
    the boundary between steps (stop agreement, periodic saves, memory-tier snapshots, the stop's
    and the end's save) and the restore; this class owns the MMDiT's set-up, its step and what it
    reports."""

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
        # Progress for the node agent's watchdog (no collective, no sync) and the stop signals'
        # handlers first: a stop signalled during set-up (data check, resume) is kept and honoured
        # after the first step instead of killing the rank with no outcome.
        site = RankSite(paths=paths, cfg=cfg, attempt=attempt, clock=clock, managed=True)
        # (the entry point registered the stack dump; without checkpoints nothing watches the run)
        self.session = sessions.begin(site, startup=self.startup, watch=checkpoints, dump_stacks=False)
        self.session.join(self.ctx.rank, self.ctx.world_size, self.ctx.host_group())
        self.progress = self.session.progress
        self.progress.cpu_time = self.ctx.device.type == "cpu"
        self.initialized: Initialized | None = None  # where the first weights came from, if not the seed
        self.last_lr = 0.0
        self._batches: Any = None
        try:
            self._build(checkpoints, echo=echo)
        except BaseException:
            sessions.end()
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
        self.startup.mark("model")
        # What a checkpoint holds (``rank.objects``): the model and AdamW through torch's
        # distributed state-dict helpers (DCP reshards them to any world size and between DDP and
        # FSDP), the EMA's shadow weights and update count (``ema``; one turned on after the
        # checkpoint was written starts from the weights), the loop's counters (``train``) and each
        # rank's RNG states. The loop draws nothing from them (determinism rule); they are kept
        # for code that does (e.g. dropout).
        objects: dict[str, Any] = {"train": self.counters}
        missing = {}
        if self.ema is not None:
            objects["ema"] = self.ema
            missing["ema"] = self.ema.reset_from_model
        attached = Attached(
            model=self.model, optimizers=[self.opt], objects=objects, data=None, rank=ctx.rank,
            device=ctx.device, missing=missing,
        )  # fmt: skip
        self.rank_run = RankRun(cfg, ctx, self.paths, self.attempt, self.session.ledger, self.counters)
        self.reports = Reports(self.rank_run, echo=echo)
        hooks = RunHooks(
            manifest_extra=self._manifest_extra,
            before_last_save=[self._before_last_save],
            resumed_fields=self._resumed_fields,
            on_stopped=lambda cause, step: self.reports.mark(
                "stopped", f"stopped after step {step}: {cause}"
            ),
            on_finished=lambda step: self.reports.mark("finished", f"finished at step {step}"),
            marks_phases=True,
            step_sleep=False,
            records_outcome=False,
            sharded=self.sharded,
        )
        hashes = {"config_hash": cfg.config_hash(), "model_hash": cfg.model_hash()}
        self.run_state = open_run(
            self.session, ctx, attached, hashes=hashes, hooks=hooks, checkpoints=checkpoints, echo=echo
        )

    # ---- what the run's saves and records hold beside the state -------------------------------

    def app_state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (``rank.objects``' layout)."""
        return self.run_state._state()

    def snapshot_state(self) -> dict[str, Any]:
        """``app_state`` for the memory tier: the model's and optimizer's state dicts made once and
        reused (``rank.state_cache``: the same live tensors, hyperparameters refreshed)."""
        return self.run_state._snapshot_state()

    def _manifest_extra(self) -> dict[str, Any]:
        c = self.counters
        return {
            "samples_consumed": c.samples_consumed,
            "skipped_total": c.skipped_total,
            "parallel": self.cfg.train.parallel,
            "ema": self.ema is not None,
            "model": self.cfg.model.model_dump(mode="json"),  # names what differs on a refusal
        }

    def _resumed_fields(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.counters.samples_consumed,
            "parallel": self.cfg.train.parallel,
            "token_shards_checked": self.data.checked_shards,
        }

    def _before_last_save(self) -> None:
        self.profiler.finish()  # (a stop inside the profiled steps: what it has)
        self._batches = None  # stops the loader's workers before the final save

    def resume(self) -> None:
        """Before the first step: with no state of its own restored, ``train.init_from``'s weights."""
        if (
            self.run_state.restored.checkpoint is None
            and self.cfg.train.init_from
            and self.initialized is None
        ):
            from .model.init_from import init_weights

            self.initialized = init_weights(self.cfg, self.ctx, self.model, self.ema, self.session.ledger)

    def save(self, *, blocking: bool, supersede: bool = False) -> None:
        """Checkpoint the state after step ``counters.step`` (collective; ``rank.saving``)."""
        if self.run_state.saves.disk is not None:
            self.run_state.saves.disk.save(blocking=blocking, supersede=supersede)

    def act_on_failed_background_save(self) -> None:
        """Save again, blocking, if a background save failed (``rank.saving``)."""
        if self.run_state.saves.disk is not None:
            self.run_state.saves.disk.act_on_failed_background_save(self.ctx.host_group())

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
        if applied:
            if t.grad_clip is not None:
                clip_(grads, t.grad_clip, norm)
            # (the run's pre-hook on opt.step: a save's or snapshot's staging copies finish first)
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
        with self.run_state.phase("eval"):
            self.run_state.before_update()  # (the EMA is swapped into the live weights)
            # The bare model, not the DDP wrapper (no gradient hooks); under FSDP the sharded root.
            if self.ema is None:
                return self.evaluator.run(self.model, autocast=self.autocast)
            with self.ema.applied(before=lambda: reshard(self.model)):
                return self.evaluator.run(self.model, autocast=self.autocast)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> AttemptOutcome:
        t = self.cfg.train
        self.resume()
        c = self.counters
        # TensorBoard and/or W&B (``explog``) only for runs that keep checkpoints
        self.reports.open(
            experiment_logs=self.run_state.saves.checkpointer is not None, initialized=self.initialized
        )
        self._batches = iter(self.feed.loader(self.data))
        self.profiler = StepProfiler(
            t.profile, self.paths.root / "profile", self.ctx.rank, self.ctx.device.type
        )
        try:
            for step in self.run_state.steps(total=t.steps):
                self.profiler.before_step(step)
                t0 = time.perf_counter()
                self.progress.phase("data", step)
                item = next(self._batches)
                raise_data_problem(item)
                self.buckets.settle(item)  # every attempt's first step on DDP's rebuilt buckets
                applied, loss, text, latent, norm = self.train_step(item)
                if sleep_s := step_sleep_s(self.cfg, resumed=self.run_state.resumed_from is not None):
                    time.sleep(sleep_s)
                dt = time.perf_counter() - t0
                self.profiler.after_step(c.step, dt)
                self.compile_cache.after_step(c.step)
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
        except Stopped as stopped:
            if self.reports.window.steps:
                self.reports.log_window(None, lr=self.last_lr)
            return self.outcome("stopped", stopped.cause)
        return self.outcome("finished", None)

    # ---- the end ------------------------------------------------------------------------------

    def outcome(self, status: Status, cause: Cause | None, error: str | None = None) -> AttemptOutcome:
        """The attempt's outcome with every rank's counters and digests (collective; ``reports``)."""
        digests = state_digests(self.model, self.opt, self.ema, sharded=self.sharded)
        return self.reports.outcome(status, cause, error, digests=digests)

    def close(self) -> None:
        self.reports.close()
        self.run_state.close()  # (the memory tier keeps its snapshots for an in-place restart)
        sessions.end()
