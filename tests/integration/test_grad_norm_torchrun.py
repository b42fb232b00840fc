"""The global grad norm on local shards (``trainer.grads``) is torch's over the whole DTensors, on two
real gloo ranks: sharded (the squares summed over the shard group) and replicated (HSDP with shard
groups of one: nothing summed, the replicas already agree); clipping brings it to the bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).parent / "helpers" / "grad_norm_worker.py"


def test_the_norm_on_local_shards_is_the_global_norm_and_clipping_holds(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [
        json.loads(line) for f in sorted(tmp_path.glob("rank*.jsonl")) for line in f.read_text().splitlines()
    ]
    assert {(r["layout"], r["rank"]) for r in rows} == {
        (lay, r) for lay in ("shard", "replicate") for r in (0, 1)
    }
    for r in rows:
        assert r["ours"] == pytest.approx(r["expected"], rel=1e-6), r
        assert r["expected"] > 0.5 and r["clipped"] == pytest.approx(0.5, rel=1e-5), r
