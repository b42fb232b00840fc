"""``hpclaunch preflight`` end to end on this machine: the real probe (the job's Python importing
torch and mmdit, the model built on the meta device), real data, real disk, real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpclaunch.config import ModelConfig
from hpclaunch.shards import synth_dataset

TINY = """\
name: tiny
train: {steps: 20, global_batch: 8, warmup_steps: 2}
checkpoint: {every_steps: 10}
data: {token_dir: data/tokens, latent_dir: data/latents}
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("preflight")
    synth_dataset(d / "data", samples=128, seed=0, model_cfg=ModelConfig(), shard_size=32)
    (d / "tiny.yaml").write_text(TINY)
    return d


def hpclaunch(cwd: Path, *args: str, importtime: bool = False) -> subprocess.CompletedProcess[str]:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "hpclaunch", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_good_tiny_config_passes_or_skips_with_reasons(workdir: Path) -> None:
    start = time.monotonic()
    result = hpclaunch(workdir, "preflight", "tiny.yaml", "--json")
    wall = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)  # stdout holds the JSON and nothing else
    assert report["ok"] is True
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "env",
        "gpu",
        "data",
        "disk",
        "network",
        "scheduler",
        "config",
        "fds",
        "container",
        "script",
    ]
    for c in report["checks"]:
        assert c["status"] in ("pass", "skip"), c
        assert c["finding"], c
        assert set(c) == {"name", "status", "finding", "hint", "seconds"}
    by = {c["name"]: c for c in report["checks"]}
    assert "torch" in by["env"]["finding"] and "mmdit" in by["env"]["finding"]
    assert by["gpu"]["finding"] == "CPU run (gpus_per_node 0)"
    assert "348.0k parameters" in by["disk"]["finding"]  # exact: the probe built the model
    assert by["script"]["status"] == "skip"  # (the built-in trainer: no script to probe)
    # "a few seconds" (issue 6) is bench/preflight.py's figure: a loaded CI machine's wall time is no test
    print(f"preflight checks {report['seconds']:.2f} s, command {wall:.2f} s")


def test_cli_process_never_imports_torch(workdir: Path) -> None:
    result = hpclaunch(workdir, "preflight", "tiny.yaml", "--json", importtime=True)
    assert result.returncode == 0, result.stderr[-2000:]
    json.loads(result.stdout)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("import time:")]
    assert lines, "no -X importtime output"
    assert sum("torch" in ln for ln in lines) == 0  # the probe subprocess imports it, not the CLI
    assert not any(ln.rsplit("|", 1)[-1].strip().startswith("mmdit") for ln in lines)


def test_failing_check_exits_1_with_json(workdir: Path) -> None:
    result = hpclaunch(
        workdir, "preflight", "tiny.yaml", "--json", "--only", "data,network", "--set", "data.latent_dir=nope"
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False and [c["name"] for c in report["checks"]] == ["data", "network"]
    data = report["checks"][0]
    assert data["status"] == "fail" and "latent directory does not exist" in data["finding"] and data["hint"]
    assert "1 check(s) failed: data" in result.stderr


def test_table_output(workdir: Path) -> None:
    result = hpclaunch(workdir, "preflight", "tiny.yaml", "--only", "network,data")  # no probe: fast
    assert result.returncode == 0, result.stderr
    assert "preflight (login) ok: 2 pass" in result.stdout and "shard pair(s)" in result.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--only", "data,gpus"], "unknown login check 'gpus' (did you mean gpu?)"),
        (["--set", "train.stepz=3"], "did you mean train.steps"),
        (["--set", "nccl.preset=infiniband"], "nccl.preset"),
    ],
)
def test_bad_input_exits_2(workdir: Path, args: list[str], words: str) -> None:
    result = hpclaunch(workdir, "preflight", "tiny.yaml", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
