"""``hpclaunch train`` in a terminal (a real pseudo-terminal): a live progress line redrawn in place,
although the ranks' output reaches it through torchrun and the node agent's pipe."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.runlib import TINY, synth_data

pytestmark = pytest.mark.slow

REDRAW = "\r\x1b[2K"  # carriage return + erase line: the line is redrawn, not appended


def run_in_terminal(args: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    env.pop("HPCLAUNCH_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpclaunch", *args],
        stdout=slave,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


def test_train_in_a_terminal_shows_a_live_progress_line_under_the_ranks_output(tmp_path: Path) -> None:
    data = synth_data(tmp_path / "data", samples=128)
    sets = [
        "name=live", f"data.token_dir={data / 'tokens'}", f"data.latent_dir={data / 'latents'}",
        "scheduler.procs_per_node=1", "train.steps=24", "train.warmup_steps=2", "train.log_every=4",
        "testing.step_sleep_s=0.1", "preflight.distributed_smoke=false",
    ]  # fmt: skip
    code, out = run_in_terminal(["train", str(TINY), *[a for s in sets for a in ("--set", s)]], tmp_path)
    assert code == 0, out[-3000:]
    # The ranks' own lines still scroll by ...
    assert re.search(r"step 12/24 loss \d", out), out[-3000:]
    # ... and the progress line is redrawn in place at least as often as there are log windows,
    # with the step, the losses and an ETA while the run is going, and 24/24 at the end.
    redraws = [part.split("\r")[0] for part in out.split(REDRAW)[1:] if part.startswith("train ")]
    assert len(redraws) >= 4, out[-3000:]
    assert any(
        re.search(r" 8/24  loss \d+\.\d{4} \(text \d+\.\d{3}, latent \d+\.\d{3}\).* ETA 0:00:\d\d", r)
        for r in redraws
    )
    assert re.search(r" 24/24  loss ", redraws[-1])
    assert out.rstrip().endswith("finished at step 24")
    assert out.count("finished at step 24") == 1, out[-3000:]  # the last word, said once (issue 39)
