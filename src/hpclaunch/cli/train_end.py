"""What a foreground ``hpclaunch train`` says last, and the exit code it ends with.

The exit code names how the run ended: 0 finished, 1 failed, 3 ended by the user (``hpclaunch
stop`` from any shell, Ctrl-C, or ``hpclaunch cancel``), 4 stopped at the time limit, 5 preempted.
How the run ended is the login flow's (``orchestrator.login_flow.foreground_outcome``); this says it.
"""

from __future__ import annotations

from pathlib import Path

from ..orchestrator.login_flow import foreground_outcome
from ..rundir import RunPaths
from ..rundir.cause import STOP_EXIT_CODES, Cause
from ..rundir.outcome import AttemptOutcome
from ..templates.shell import join
from .common import console, err_console


def last_word(paths: RunPaths, config: list[Path], overrides: list[str] | None, agent_code: int) -> int:
    """Print how the run ended (one line; a failure's reason on stderr) and return the exit code."""
    outcome = foreground_outcome(paths)
    if outcome is not None and outcome.status == "failed":
        # The reason is the last line; the rank host's own report stays in the node log.
        console.print(
            f"failed at step {outcome.step} ({outcome.cause}); the ranks' full report is in {paths.logs}/",
            highlight=False,
            markup=False,
        )
        err_console.print(f"hpclaunch: training failed: {outcome.error}", highlight=False, markup=False)
    elif outcome is not None and outcome.status != "stopped":
        console.print(f"{outcome.status} at step {outcome.step}", highlight=False)
    elif outcome is not None:
        # What continues a foreground run is this command, not `submit --resume`; a run named by its
        # directory (its own config.yaml) or a script's (no CONFIG) by that directory, as the user
        # can: every word quoted, to be copied as printed.
        own = len(config) == 1 and config[0].resolve() == paths.config.resolve()
        named = [paths.root] if own or not config else config
        again = join([*map(str, named), *(w for o in overrides or [] for w in ("--set", o))])
        how = "cancelled" if outcome.cause is Cause.CANCELLED else "stopped"
        console.print(
            f"{how} at step {outcome.step} ({outcome.cause}); continue it: hpclaunch train {again} --resume",
            highlight=False,
            markup=False,  # a command to copy: printed as it is, never broken across lines
            soft_wrap=True,
        )
    return exit_code(outcome, agent_code)


def exit_code(outcome: AttemptOutcome | None, agent_code: int) -> int:
    if outcome is None:
        return agent_code or 1
    if outcome.status == "finished":
        return 0
    if outcome.status == "stopped":
        return STOP_EXIT_CODES.get(outcome.cause or Cause.USER, 3)
    return 1
