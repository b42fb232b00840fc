"""The scheduler check: sinfo / qstat output parsing and the findings, with the tools faked
(the real SLURM runs in tests/cluster/test_preflight_slurm.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.config import RunConfig
from hpclaunch.preflight import Status
from hpclaunch.preflight.check_context import CheckContext, CommandResult
from hpclaunch.preflight.probe import StaticProbe
from hpclaunch.preflight.scheduler_check import (
    check_scheduler,
    gres_gpus,
    parse_qstat_queues,
    parse_qstat_table,
    parse_sinfo,
    parse_slurm_time,
)

pytestmark = pytest.mark.fast

# sinfo -h -a -N -o "%P|%a|%l|%N|%T|%G|%f" on a GPU cluster (one line per node and partition)
SINFO_GPU = """\
gpu*|up|2-00:00:00|gpu001|idle|gpu:h100:8(S:0-1)|h100,ib
gpu*|up|2-00:00:00|gpu002|mixed|gpu:h100:8(S:0-1)|h100,ib
gpu*|up|2-00:00:00|gpu003|drained|gpu:h100:8(S:0-1)|h100,ib
gpu*|up|2-00:00:00|gpu004|idle|gpu:h100:4|h100,ib
cpu|up|1-00:00:00|cpu001|idle|(null)|(null)
cpu|up|1-00:00:00|cpu002|down*|(null)|(null)
debug|up|30:00|gpu001|idle|gpu:h100:8(S:0-1)|h100,ib
"""
# what the local test cluster answers (tests/cluster): no gres, no features
SINFO_LOCAL = "debug*|up|infinite|vm|idle|(null)|(null)\nshort|up|5:00|vm|idle|(null)|(null)\n"

QSTAT_QF = """\
Queue: workq
    queue_type = Execution
    total_jobs = 0
    resources_max.walltime = 24:00:00
    enabled = True
    started = True

Queue: long
    queue_type = Execution
    enabled = True
"""
QSTAT_Q_TABLE = """\
Queue              Max   Tot   Ena   Str   Que   Run   Hld   Wat   Trn   Ext T
----------------   ---   ---   ---   ---   ---   ---   ---   ---   ---   --- -
debug                ?     ?   yes   yes     ?     ?     ?     ?     ?     ? E
short                ?     ?   yes   yes     ?     ?     ?     ?     ?     ? E
"""


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("infinite", None),
        ("UNLIMITED", None),
        ("5:00", 300),
        ("30", 1800),
        ("1:00:00", 3600),
        ("2-00:00:00", 172800),
        ("1-12", 129600),
        ("1-12:30", 131400),
    ],
)
def test_parse_slurm_time(text: str, seconds: int | None) -> None:
    assert parse_slurm_time(text) == seconds


def test_gres_gpus() -> None:
    assert gres_gpus("gpu:8") == 8
    assert gres_gpus("gpu:h100:8(S:0-1)") == 8
    assert gres_gpus("gpu:a100:4,gpu:v100:2,shard:8") == 6
    assert gres_gpus("(null)") == 0


def test_parse_sinfo() -> None:
    parts = parse_sinfo(SINFO_GPU)
    assert list(parts) == ["gpu", "cpu", "debug"]
    gpu = parts["gpu"]
    assert gpu.default and gpu.max_time_s == 172800 and len(gpu.nodes) == 4
    assert [n.usable for n in gpu.nodes] == [True, True, False, True]
    assert gpu.nodes[0].features == {"h100", "ib"} and gpu.nodes[3].gpus == 4
    assert not parts["cpu"].nodes[1].usable  # down* (not responding)
    local = parse_sinfo(SINFO_LOCAL)
    assert local["debug"].default and local["debug"].max_time_s is None and local["short"].max_time_s == 300


def test_parse_qstat() -> None:
    q = parse_qstat_queues(QSTAT_QF)
    assert q["workq"]["resources_max.walltime"] == "24:00:00" and "long" in q
    assert parse_qstat_table(QSTAT_Q_TABLE) == ["debug", "short"]


def ctx(
    tmp_path: Path, outputs: dict[str, CommandResult | None], *, missing: Sequence[str] = (), **sched: Any
):
    sched.setdefault("kind", "slurm")
    raw = {"scheduler": sched, "train": {"global_batch": 64}}
    cfg = RunConfig.model_validate(raw).resolved(tmp_path)

    def run(argv: Sequence[str], timeout: float) -> CommandResult | None:
        return outputs.get(" ".join(argv[:2]))

    return CheckContext(
        cfg=cfg,
        node=None,
        probe=StaticProbe(),
        run=run,
        which=lambda tool: None if tool in missing else f"/usr/bin/{tool}",
    )


def sinfo(text: str) -> dict[str, CommandResult | None]:
    return {"sinfo -h": CommandResult(0, text, "")}


def test_slurm_pass(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), nodes=2, gpus_per_node=8, time_limit="12:00:00"))
    assert out.status is Status.PASS
    assert out.finding == (
        "partition gpu (default): 2 node(s) with >= 8 GPUs (gres) up, MaxTime 48:00:00; run needs 2 for 12:00:00"
    )


def test_slurm_partition_does_not_exist(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), partition="gpus"))
    assert out.status is Status.FAIL
    assert out.finding == "partition 'gpus' does not exist (did you mean gpu?); partitions: gpu, cpu, debug"


def test_slurm_time_limit_over_maxtime(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), partition="debug", time_limit="00:30:01"))
    assert out.status is Status.FAIL  # SLURM rounds up to whole minutes: 31 > 30
    assert "time_limit 00:30:01 exceeds partition debug's MaxTime 00:30:00" in out.finding
    ok = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), partition="debug", time_limit="30m"))
    assert ok.status is Status.PASS


def test_slurm_not_enough_gpu_nodes(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), nodes=4, gpus_per_node=8))
    assert out.status is Status.FAIL
    assert "partition gpu (default) has 3 node(s) with >= 8 GPUs (gres); the run asks for 4" in out.finding
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), partition="cpu", nodes=1, gpus_per_node=1))
    assert out.status is Status.FAIL and "has 0 node(s) with >= 1 GPUs" in out.finding


def test_slurm_exclude_and_constraint_count(tmp_path: Path) -> None:
    out = check_scheduler(
        ctx(
            tmp_path,
            sinfo(SINFO_GPU),
            nodes=2,
            gpus_per_node=4,
            exclude=["gpu001", "gpu002"],
            constraint="ib",
        )
    )
    assert out.status is Status.WARN  # gpu003 (drained) and gpu004 remain; one is up
    assert "only 1 of 2 node(s)" in out.finding and "gpu003 drained" in out.finding
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU), constraint="a100"))
    assert out.status is Status.FAIL and "has 0 node(s) and features a100" in out.finding


def test_slurm_tools_missing_or_failing(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, {}, missing=("sbatch", "squeue", "sinfo")))
    assert out.status is Status.FAIL and out.finding == "sbatch, squeue, sinfo not found on PATH"
    down = {"sinfo -h": CommandResult(1, "", "slurm_load_partitions: Unable to contact slurm controller")}
    out = check_scheduler(ctx(tmp_path, down))
    assert out.status is Status.FAIL and "Unable to contact slurm controller" in out.finding


def test_slurm_no_default_partition(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, sinfo(SINFO_GPU.replace("gpu*", "gpu"))))
    assert out.status is Status.FAIL and "no default partition" in out.finding


def test_pbs(tmp_path: Path) -> None:
    qf = {"qstat -Q": CommandResult(0, QSTAT_QF, "")}
    assert check_scheduler(ctx(tmp_path, qf, kind="pbs", partition="workq")).status is Status.PASS
    out = check_scheduler(ctx(tmp_path, qf, kind="pbs", partition="workq", time_limit="25:00:00"))
    assert out.status is Status.FAIL and "resources_max.walltime 24:00:00" in out.finding
    out = check_scheduler(ctx(tmp_path, qf, kind="pbs", partition="wrkq"))
    assert out.status is Status.FAIL and "queue 'wrkq' does not exist (did you mean workq?)" in out.finding


def test_pbs_without_queue_listing(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, {}, kind="pbs", partition="workq", missing=("qstat",)))
    assert out.status is Status.PASS and "queues not checked (qstat not found)" in out.finding
    out = check_scheduler(ctx(tmp_path, {}, kind="pbs", missing=("qsub",)))
    assert out.status is Status.FAIL and "qsub not found" in out.finding


def test_local_needs_no_scheduler(tmp_path: Path) -> None:
    out = check_scheduler(ctx(tmp_path, {}, kind="local"))
    assert out.status is Status.SKIP and "local scheduler" in out.finding
