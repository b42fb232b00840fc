"""Smoke tests: the local SLURM cluster of scripts/local-slurm really runs jobs the way
hpclaunch needs (batch, Torque qsub with PBS_* variables, requeue, two nodes with distinct
addresses)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tests.runlib import wait_for_text

if TYPE_CHECKING:  # the fixtures' type; conftest modules are not importable by name
    from tests.cluster.conftest import SlurmCluster

pytestmark = pytest.mark.slurm
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "local-slurm"


def test_status_reports_the_running_layout(slurm_cluster: SlurmCluster) -> None:
    proc = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("up: layout 1 node(s)")
    assert slurm_cluster.nodes[0] in proc.stdout


def test_sbatch_wrap_completes(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job = slurm_cluster.sbatch("--wrap", "echo hello from $SLURM_JOB_ID", "-o", "out-%j.txt", cwd=tmp_path)
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    assert (tmp_path / f"out-{job}.txt").read_text() == f"hello from {job}\n"
    info = slurm_cluster.job_info(job)
    assert info["Partition"] == "debug"
    assert info["ExitCode"] == "0:0"
    # jobcomp/filetxt: a plain-text record of finished jobs, kept next to accounting (slurmdbd).
    assert f"JobId={job} " in (slurm_cluster.state_dir / "jobcomp.txt").read_text()


def test_qsub_pbs_directives_and_environment(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.pbs"
    script.write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #PBS -N hpcl-pbs-smoke
        #PBS -l walltime=00:01:00
        #PBS -l nodes=1:ppn=1
        env | grep '^PBS_' > {tmp_path}/pbs-env.txt
        """)
    )
    out = subprocess.run(
        ["qsub", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True
    )
    job = out.stdout.strip()
    assert job.isdigit(), out
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED"
    env = dict(line.split("=", 1) for line in (tmp_path / "pbs-env.txt").read_text().splitlines())
    assert env["PBS_JOBID"] == job
    assert env["PBS_O_WORKDIR"] == str(tmp_path)
    assert env["PBS_JOBNAME"] == "hpcl-pbs-smoke"
    info = slurm_cluster.job_info(job)
    assert (info["JobName"], info["TimeLimit"], info["NumNodes"]) == ("hpcl-pbs-smoke", "00:01:00", "1")


def test_requeue_restarts_with_restart_count(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "requeue.out"
    job = slurm_cluster.sbatch(
        "--open-mode=append",
        "-o",
        str(out),
        "--wrap",
        'echo "restart=${SLURM_RESTART_COUNT:-0}"; sleep 300',
        cwd=tmp_path,
    )
    try:
        wait_for_text(out, "restart=0", timeout=30)
        start = time.monotonic()
        slurm_cluster.run("scontrol", "requeue", job)
        text = wait_for_text(out, "restart=1", timeout=20)
        elapsed = time.monotonic() - start
        info = slurm_cluster.job_info(job)
        assert (info["JobState"], info["Restarts"]) == ("RUNNING", "1"), info
        assert "DUE TO JOB REQUEUE" in text
        print(f"requeue round trip {elapsed:.1f}s")
    finally:
        slurm_cluster.cancel(job)


def test_short_partition_refuses_a_longer_time_limit(slurm_cluster: SlurmCluster) -> None:
    too_long = str(slurm_cluster.short_max_minutes + 1)
    proc = subprocess.run(
        ["sbatch", "-p", "short", "-t", too_long, "--wrap", "true"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0
    assert "time limit" in proc.stderr.lower()


def test_two_nodes_have_distinct_addresses(slurm_cluster_2nodes: SlurmCluster) -> None:
    cluster = slurm_cluster_2nodes
    assert cluster.node_addrs == {"n1": "10.200.0.11", "n2": "10.200.0.12"}
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "bash", "-c", "echo $SLURMD_NODENAME $(hostname -I)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert sorted(line.split() for line in out.splitlines()) == [
        ["n1", "10.200.0.11"],
        ["n2", "10.200.0.12"],
    ]
    for node, addr in cluster.node_addrs.items():
        record = cluster.run("scontrol", "show", "node", "-o", node)
        assert f"NodeAddr={addr} " in record


def test_two_node_job_connects_across_nodes(slurm_cluster_2nodes: SlurmCluster, tmp_path: Path) -> None:
    """What torchrun's rendezvous needs: rank 1 reaches a server on node 0's NodeAddr."""
    (tmp_path / "pair.py").write_text(
        textwrap.dedent("""\
        import os, socket, sys, time
        addr, port = sys.argv[1], int(sys.argv[2])
        me = os.environ["SLURMD_NODENAME"]
        if os.environ["SLURM_PROCID"] == "0":
            with socket.create_server((addr, port)) as srv:
                conn, _ = srv.accept()
                print(me, "got", conn.recv(100).decode(), flush=True)
        else:
            for _ in range(100):
                try:
                    with socket.create_connection((addr, port), timeout=2) as c:
                        c.sendall(me.encode())
                    break
                except OSError:
                    time.sleep(0.1)
        """)
    )
    (tmp_path / "job.sh").write_text(
        textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH -N2 --ntasks-per-node=1 -o {tmp_path}/job.out
        first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)
        addr=$(scontrol show node -o "$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
        srun {sys.executable} {tmp_path}/pair.py "$addr" $((20000 + SLURM_JOB_ID % 10000))
        """)
    )
    job = slurm_cluster_2nodes.sbatch(str(tmp_path / "job.sh"), cwd=tmp_path)
    assert slurm_cluster_2nodes.wait_job(job, timeout=60) == "COMPLETED", (tmp_path / "job.out").read_text()
    assert (tmp_path / "job.out").read_text().strip() == "n1 got n2"
