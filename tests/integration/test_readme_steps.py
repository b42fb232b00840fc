"""README's step list, run top to bottom as a new user would right after `make demo` (issue 26: it
failed at `data synth data/tiny`, and `hpclaunch` was not on the PATH): every line exits 0.

The folder stands in for a fresh clone after `make demo`: `.venv` (this one), `data/tiny` (what the
demo writes), `examples/`. Lines run one by one with `bash -e`, so the first failing line is named.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.runlib import ROOT, synth_data

pytestmark = pytest.mark.slow


def readme_steps() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- steps:begin.*?```sh\n(.*?)```\s*<!-- steps:end -->", text, re.S)
    assert block, "README has no step list between <!-- steps:begin --> and <!-- steps:end -->"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_step_list_exits_0_at_every_line_after_make_demo(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(Path(sys.prefix))  # this venv
    (clone / "data").mkdir()
    synth_data(clone / "data" / "tiny", samples=1024)  # as `make demo` leaves it
    env = {k: v for k, v in os.environ.items() if k not in ("HPCLAUNCH_DEBUG", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # hpclaunch only through the venv, as in a fresh shell
    script = "set -e\n" + "\n".join(
        f"echo '>>> {i}' >&2\n{line.split('  #')[0].strip()}" for i, line in enumerate(readme_steps())
    )
    done = subprocess.run(
        ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=900
    )
    failed_at = re.findall(r">>> (\d+)", done.stderr)
    line = readme_steps()[int(failed_at[-1])] if failed_at else "?"
    assert done.returncode == 0, (
        f"exit {done.returncode} at: {line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
