"""The distributed smoke test under real torchrun: 2 processes, gloo, on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = """\
import datetime, json, os, sys
import torch.distributed as dist
from hpclaunch.errors import PreflightFailed
from hpclaunch.rank.smoke import run_distributed_smoke

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
out = {"rank": rank}
try:
    run_distributed_smoke(float(sys.argv[2]))
    out["ok"] = True
except PreflightFailed as e:
    out["ok"] = False
    out["error"] = e.one_line()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
if out["ok"]:
    # Leaving with live gloo threads can abort the process ("terminate called without an active
    # exception"); a rank whose peer is gone cannot tear down cleanly, so only the good path does.
    dist.destroy_process_group()
sys.exit(0 if out["ok"] else 3)
"""


def torchrun(tmp_path: Path, timeout_s: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun_bin = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [
            str(torchrun_bin),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path),
            str(timeout_s),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def read(tmp_path: Path, rank: int) -> dict:
    import json

    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def test_smoke_passes(tmp_path: Path) -> None:
    res = torchrun(tmp_path, 10, {})
    assert res.returncode == 0, res.stderr[-3000:]
    assert read(tmp_path, 0)["ok"] and read(tmp_path, 1)["ok"]


def test_slow_rank_is_named_by_rank_0(tmp_path: Path) -> None:
    res = torchrun(tmp_path, 2, {"HPCLAUNCH_SMOKE_DELAY": "1:6"})
    assert res.returncode != 0
    r0 = read(tmp_path, 0)
    assert r0["ok"] is False
    assert "rank 1 on " in r0["error"] and "did not reach the barrier within 2 s (2 ranks)" in r0["error"]
    assert r0["error"].startswith("rank 0 on ")  # where: the reporting rank
