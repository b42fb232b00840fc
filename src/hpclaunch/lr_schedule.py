"""The learning rate of every optimizer step, and what a resume that changes the run does to it.

The rule, one function (``lr_at``): a linear warmup over ``train.warmup_steps``, then a cosine from
``train.lr`` down to ``min_lr_ratio x lr`` at the schedule's last step (``train.lr_schedule_steps``;
null: ``train.steps``), and that floor past it. A pure function of the step and the config: every
rank, every attempt and ``status`` compute the same LR, and no checkpoint holds schedule state.

Training further (``submit --resume RUN --set train.steps=N``), ``train.lr_schedule_on_resume``:

- ``keep`` (the default): the schedule keeps the length the run had (``lr_schedule_steps`` is
  pinned to it), so the LR at the resumed step is the one the run would have had, and the steps
  past that length train at the floor. What users of nanoGPT get (its ``lr_decay_iters`` stays
  when ``max_iters`` grows, the LR flat at ``min_lr`` past it) and of Lightning (its scheduler's
  state, ``T_max`` included, comes back from the checkpoint). No jump at a resume, ever.
- ``stretch``: the schedule is fitted to the new ``train.steps``, as torchtitan rebuilds its
  schedule from ``training.steps`` on every start: the LR at the resumed step changes, up for a
  longer run (a re-warming without warmup), down for a shorter one (a stop at step 422 of a long
  run resumed to end at 500: a 6.6x drop).

Either way, a resume that changes the schedule or the global batch says so in one line
(``ResumeChange.line``): at submit, in the ledger (``schedule_changed``) and in ``status``.
Torch-free: the CLI computes it before submitting.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .config import RunConfig, TrainConfig

LENGTH_KEY = "train.lr_schedule_steps"


def schedule_length(t: TrainConfig) -> int:
    """The step the cosine ends at: ``train.lr_schedule_steps``, else ``train.steps``."""
    return t.lr_schedule_steps or t.steps


def lr_at(step: int, t: TrainConfig) -> float:
    """LR of optimizer step ``step`` (1-based): linear warmup, then cosine to ``min_lr_ratio * lr`` at
    the schedule's length, and that floor past it."""
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    span = max(1, schedule_length(t) - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    low = t.lr * t.min_lr_ratio
    return low + (t.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def pinned_length(old: TrainConfig, new: TrainConfig, overrides: list[str]) -> str | None:
    """The ``--set`` a resume adds so that its schedule follows ``train.lr_schedule_on_resume``: the
    run's length kept (``train.steps`` unchanged, or ``keep``) or the pin dropped (``stretch`` to new
    steps); None when nothing is to add (the length already right, or the user set it himself).
    ``new`` may come from the user's CONFIG file (``train CONFIG --resume``), which lacks the pin an
    earlier resume recorded: lengths are compared, not the keys."""
    if any(o.partition("=")[0].strip() == LENGTH_KEY for o in overrides):
        return None
    if new.steps == old.steps or new.lr_schedule_on_resume == "keep":
        length = schedule_length(old)
        return None if schedule_length(new) == length else f"{LENGTH_KEY}={length}"
    return f"{LENGTH_KEY}=null" if new.lr_schedule_steps is not None else None


@dataclass(frozen=True)
class ResumeChange:
    """What a resume changes from its first step (``step``) on: the ledger's ``schedule_changed``."""

    step: int
    rule: str  # train.lr_schedule_on_resume
    steps_before: int
    steps_after: int
    length_before: int
    length_after: int
    lr_before: float  # at ``step``, by the run's config as it was
    lr_after: float  # at ``step``, by the resumed config
    lr_other_rule: float | None  # at ``step``, had the other rule applied (train.steps changed)
    batch_before: int
    batch_after: int

    def fields(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line()}

    def line(self) -> str:
        """One line: what changed from which step, and what the LR does there."""
        parts = []
        s = self.step
        if self.steps_before != self.steps_after:
            parts.append(f"train.steps {self.steps_before} -> {self.steps_after} from step {s}")
        lr = (
            f"lr {self.lr_after:.3g} at step {s}"
            if math.isclose(self.lr_before, self.lr_after, rel_tol=1e-9)
            else f"lr at step {s} {self.lr_before:.3g} -> {self.lr_after:.3g}"
        )
        if self.length_before == self.length_after:
            schedule = f"the LR schedule keeps its {self.length_after} steps, {lr}"
            if s > self.length_after:
                schedule += " (its floor: past the schedule's end)"
        else:
            schedule = f"the LR schedule spans {self.length_before} -> {self.length_after} steps, {lr}"
        if self.steps_before != self.steps_after:
            other = "stretch" if self.rule == "keep" else "keep"
            schedule += f" (train.lr_schedule_on_resume: {self.rule}"
            if self.lr_other_rule is not None:
                schedule += f"; {other}: lr {self.lr_other_rule:.3g} at step {s}"
            schedule += ")"
        parts.append(schedule)
        if self.batch_before != self.batch_after:
            parts.append(
                f"train.global_batch {self.batch_before} -> {self.batch_after} from step {s} "
                "(samples per step; the LR is not rescaled with it)"
            )
        return "resume: " + "; ".join(parts)


def resume_change(old: RunConfig, new: RunConfig, *, step: int) -> ResumeChange | None:
    """What resuming ``old``'s run as ``new`` at ``step`` (the first step it trains) changes about the
    schedule or the batch; None when nothing (the LR at ``step``, the length, the steps and the
    global batch all as they were)."""
    a, b = old.train, new.train
    other: float | None = None
    if a.steps != b.steps:
        other_length = b.steps if b.lr_schedule_on_resume == "keep" else schedule_length(a)
        other = lr_at(step, b.model_copy(update={"lr_schedule_steps": other_length}))
    change = ResumeChange(
        step=step,
        rule=b.lr_schedule_on_resume,
        steps_before=a.steps,
        steps_after=b.steps,
        length_before=schedule_length(a),
        length_after=schedule_length(b),
        lr_before=lr_at(step, a),
        lr_after=lr_at(step, b),
        lr_other_rule=other,
        batch_before=a.global_batch,
        batch_after=b.global_batch,
    )
    same = (
        a.steps == b.steps
        and change.length_before == change.length_after
        and math.isclose(change.lr_before, change.lr_after, rel_tol=1e-9)
        and a.global_batch == b.global_batch
    )
    return None if same else change
