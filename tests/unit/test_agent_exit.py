"""The node agent's exit code survives a scheduler signal that arrives while it exits.

The local controller (like SLURM) sends its warning at a fixed time before the limit; an attempt that
stopped earlier on its own deadline may be exiting just then. Python's shutdown resets the handlers
it installed to the default action, so without ``ignore_late_signals`` that warning kills the agent
and its "continue me" exit code (75) becomes a death by SIGUSR2: the run ends as failed.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

# A module global's __del__ runs late in interpreter shutdown, after the signal handlers were reset:
# the moment a real warning hit an exiting agent on a loaded machine.
SCRIPT = """
import os, signal, sys, time
from hpclaunch.jobs.agent import ignore_late_signals
from hpclaunch.jobs.stop_relay import SignalInbox
SignalInbox().install()
class LateWarning:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
late = LateWarning()
if sys.argv[1] == "ignore":
    ignore_late_signals()
sys.exit(75)
"""


@pytest.mark.parametrize(("mode", "expected"), [("ignore", 75), ("keep", -signal.SIGUSR2)])
def test_a_warning_during_exit_does_not_change_the_exit_code(mode: str, expected: int) -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, timeout=60)
    assert result.returncode == expected, result.stderr.decode()[-2000:]
