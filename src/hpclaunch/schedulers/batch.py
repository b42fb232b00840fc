"""What the SLURM and PBS schedulers do alike, each with its own commands.

A held job is released, and a job cancelled or withdrawn, by one command of the scheduler's
(``BatchCommands``: ``scontrol release``/``scancel``, ``qrls``/``qdel``); and every job leaves a
rescue behind (``schedulers.rescue_job``) the same way: its script rendered by the scheduler's
module, written into the run directory as it is handed over, then handed over held on the job it
watches, which only the scheduler knows how to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .protocol import NodeContext, RenderedJob, run_command, write_script

if TYPE_CHECKING:
    from pathlib import Path

    from ..rundir import JobPlan, RunPaths


@dataclass(frozen=True)
class BatchCommands:
    release: tuple[str, ...]  # starts a held job
    cancel: tuple[str, ...]  # takes a job back (a withdrawn attempt too)
    cancelled: str  # what ``cancel`` did to a job, in words
    hint: str  # where the commands are not found

    def run(self, argv: list[str], *, what: str, cwd: Path | None = None, timeout: float = 60) -> str:
        """One of this scheduler's commands (``what``: its name in an error); its failure, or its
        absence, is a SchedulerError."""
        return run_command(argv, what=what, hint=self.hint, cwd=cwd, timeout=timeout)


class BatchScheduler:
    """The part of ``Scheduler`` that SLURM and PBS share; each subclass names its ``commands``
    and renders (``render_rescue``) and hands over (``hand_over_rescue``) its rescue."""

    commands: BatchCommands

    def _command(self, command: tuple[str, ...], job_id: str) -> None:
        self.commands.run([*command, job_id], what=" ".join(command))

    def release(self, paths: RunPaths, job_id: str) -> None:
        self._command(self.commands.release, job_id)

    def cancel(self, paths: RunPaths, job_id: str) -> None:
        self._command(self.commands.cancel, job_id)

    def withdraw(self, paths: RunPaths, ctx: NodeContext) -> str:
        self._command(self.commands.cancel, ctx.job_id)
        return f"{self.commands.cancelled} job {ctx.job_id}"

    def render_rescue(self, plan: JobPlan) -> RenderedJob:
        raise NotImplementedError

    def hand_over_rescue(self, script: Path, paths: RunPaths, job_id: str) -> str:
        """Submit the written rescue ``script``, held on ``job_id``; its job id."""
        raise NotImplementedError

    def submit_rescue(self, plan: JobPlan, paths: RunPaths, job_id: str) -> str:
        """Write the rescue script (exactly ``render_rescue``) and hand it over, held on ``job_id``."""
        return self.hand_over_rescue(write_script(paths, self.render_rescue(plan)), paths, job_id)
