"""What an attempt reports while it trains and when it ends.

``Reports`` owns the metrics window (sums kept on the device between log steps), rank 0's
``metrics.jsonl`` and console (``metrics.MetricsLog``), TensorBoard and/or W&B (``explog``) with the
marks where the attempt resumed, stopped or finished, the ledger's ``stopped``, and the warnings said on the way (an
experiment log that failed, a background checkpoint saved again). ``outcome`` is the attempt's end:
every rank's counters and digests, gathered (a collective), in an ``AttemptOutcome``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch.distributed as dist

from ...config import RunConfig
from ...modelmath import peak_tflops, train_flops_per_sample
from ...rank.dist import DistContext, all_gather_json
from ...rundir import EXPERIMENT_LOG_FAILED, AttemptOutcome
from ...rundir.cause import Cause
from ...rundir.outcome import Status
from ..rank_run import RankRun
from .explog import ExperimentLogs, open_experiment_logs
from .metrics_window import MetricsLog, MetricsWindow, Window, max_memory_gb

if TYPE_CHECKING:
    from ..model.init_from import Initialized

__all__ = ["Reports", "model_flops"]


def model_flops(cfg: RunConfig, ctx: DistContext) -> tuple[int, float | None]:
    """(model FLOPs of one optimizer step, the GPU's dense bf16 peak in TFLOP/s or None): the peak
    is known for the GPUs of ``modelmath.PEAK_BF16_TFLOPS`` only, and never for CPU ranks, whose
    TFLOP/s and MFU are not reported."""
    flops = train_flops_per_sample(cfg.model) * cfg.train.global_batch
    if ctx.device.type != "cuda":
        return flops, None
    import torch

    return flops, peak_tflops(torch.cuda.get_device_name(ctx.device))


class Reports:
    """One rank's reporting; the logs are rank 0's, opened by ``open`` once the counters are known."""

    def __init__(self, run: RankRun, *, echo: bool) -> None:
        self.cfg, self.ctx, self.paths, self.attempt = run.cfg, run.ctx, run.paths, run.attempt
        self.ledger = run.ledger
        self.counters = run.counters
        self.echo = echo
        self.window = MetricsWindow(run.ctx.device)
        self.model_flops = model_flops(run.cfg, run.ctx)  # (per step, the GPUs' peak), for TFLOP/s and MFU
        self.log: MetricsLog | None = None
        self.tb: ExperimentLogs | None = None

    def open(self, *, experiment_logs: bool, initialized: Initialized | None) -> None:
        """Rank 0: ``metrics.jsonl`` from the current step on and, with ``experiment_logs``,
        TensorBoard/W&B marked with where this attempt began."""
        if not self.ctx.is_main:
            return
        c = self.counters
        self.log = MetricsLog(
            self.paths.metrics,
            total_steps=self.cfg.train.steps,
            start_step=c.step,
            echo=self.echo,
            attempt=self.attempt,
        )
        if experiment_logs:
            self.tb = open_experiment_logs(
                self.cfg,
                self.paths.root,
                attempt=self.attempt,
                resumed_step=c.step,
                on_failure=self.experiment_log_failed,
            )
        if self.tb is not None:
            self.tb.mark("resumed", c.step, self.resume_text(initialized))

    def resume_text(self, initialized: Initialized | None) -> str:
        c = self.counters
        start = f"resumed from step {c.step}" if c.step else "started"
        if not c.step and initialized is not None:
            start += f" from the {initialized.describe()}"
        n = self.ctx.world_size
        how = f"{n} ranks, {self.cfg.train.parallel}" if n > 1 else "1 rank, unwrapped"  # (dist.wrap_model)
        return f"{start} (attempt {self.attempt}, {how})"

    def log_window(self, val: Window | None, *, lr: float) -> None:
        """The window's means, reduced over the ranks (a collective), to the logs; then reset."""
        cfg, c = self.cfg, self.counters
        reduce = (lambda x: dist.all_reduce(x)) if self.ctx.initialized and self.ctx.world_size > 1 else None
        rec = self.window.collect(reduce, self.ctx.world_size)
        if self.log is None:
            return
        st = rec["step_time_s"]
        sps = cfg.train.global_batch / st if st else None
        flops_per_step, peak = self.model_flops
        tflops = flops_per_step / st / self.ctx.world_size / 1e12 if st and peak else None
        rec.update(
            step=c.step,
            lr=lr,
            samples_per_s=sps,
            tokens_per_s=sps * (cfg.model.text_len + cfg.model.latent_len) if sps else None,
            tflops_per_gpu=tflops,
            mfu=tflops / peak if tflops is not None and peak else None,
            skipped=c.skipped_total,
            max_memory_gb=max_memory_gb(self.ctx.device),
            **(val or {}),
        )
        self.log.write(rec)
        if self.tb is not None:
            self.tb.scalars(rec)

    def mark(self, kind: str, text: str) -> None:
        """A mark in TensorBoard/W&B where the attempt stopped or the run finished."""
        if self.tb is not None:
            self.tb.mark(kind, self.counters.step, text)

    def message(self, text: str) -> None:
        """A line on rank 0's console (beside the progress bar), once the log is open."""
        if self.log is not None:
            self.log.message(text)

    def experiment_log_failed(self, log: str, error: str, action: str) -> None:
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

    def gather_summaries(self, digests: Mapping[str, object]) -> list[dict[str, object]]:
        """Every rank's counters and ``digests`` (collective; DDP replicas must agree)."""
        c = self.counters
        mine: dict[str, object] = {
            "rank": self.ctx.rank,
            "step": c.step,
            "samples_consumed": c.samples_consumed,
        }
        mine |= {"skipped": c.skipped_total, **digests}
        return list(all_gather_json(mine, self.ctx.host_group()))

    def outcome(
        self, status: Status, cause: Cause | None, error: str | None, *, digests: Mapping[str, object]
    ) -> AttemptOutcome:
        """The attempt's outcome with every rank's summary (collective: every rank calls it)."""
        ranks = self.gather_summaries(digests)
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
        if self.log is not None:
            self.log.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None
