"""Smoke tests: the OpenPBS of scripts/local-pbs behaves the way hpclaunch relies on (jobs run as
the job user with real PBS first in PATH, kill_delay between SIGTERM and SIGKILL, qrerun shows as
substate RERUN, one agent per node through pbsdsh and MPICH's mpiexec over TM, host= selection)."""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from tests.pbs.conftest import user_dir
from tests.runlib import wait_for_text

if TYPE_CHECKING:
    from tests.pbs.conftest import PbsServer

pytestmark = pytest.mark.pbs
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "local-pbs"


def job_script(body: str, *directives: str) -> str:
    lines = ["#!/bin/bash", "#PBS -j oe", *[f"#PBS {d}" for d in directives], textwrap.dedent(body)]
    return "\n".join(lines) + "\n"


def submit(server: PbsServer, directory: Path, text: str, *args: str) -> str:
    script = directory / "job.sh"
    script.write_text(text)
    script.chmod(0o644)
    return server.qsub(*args, str(script), cwd=directory)


def test_status_and_a_rerun_of_up_is_fast(pbs_server: PbsServer) -> None:
    t0 = time.monotonic()
    up = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, check=False)
    assert up.returncode == 0, up.stderr
    assert time.monotonic() - t0 < 5
    status = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True, check=False)
    assert status.returncode == 0 and status.stdout.startswith("up: layout 1 node(s): pbshead"), status.stdout


def test_a_job_runs_as_the_job_user_with_real_pbs_first(pbs_server: PbsServer) -> None:
    d = user_dir(pbs_server, "smoke")
    out = d / "env.txt"
    job = submit(
        pbs_server,
        d,
        job_script(
            f"""\
            {{ echo "user=$(id -un) pwd=$(pwd)"; command -v qsub mpiexec; cat "$PBS_NODEFILE"; }} > {out}
            """,
            "-l walltime=00:01:00",
            "-l select=1:ncpus=1",
        ),
        "-W",
        "block=true",
    )
    info = pbs_server.wait_job(job, timeout=10)  # block=true returns while it is still exiting (E)
    assert (info["job_state"], info["substate"], info["Exit_status"]) == ("F", 92, 0)
    lines = out.read_text().split("\n")
    # jobs start in $HOME (scripts cd to the run directory themselves)
    assert lines[0] == f"user={pbs_server.user} pwd=/home/{pbs_server.user}"
    assert lines[1:4] == ["/opt/pbs/bin/qsub", "/opt/hpclaunch-pbs/bin/mpiexec", "pbshead"]


def test_qdel_of_a_user_job_leaves_it_time_after_sigterm(pbs_server: PbsServer) -> None:
    """What the stop protocol has after a qdel or qrerun: SIGTERM, then up to kill_delay seconds
    (for a root job pbs_mom would declare it ended at once and leave its processes running)."""
    d = user_dir(pbs_server, "killdelay")
    log = d / "log.txt"
    body = f"""\
        exec python3 -u -c '
        import signal, sys, time
        term = []
        signal.signal(signal.SIGTERM, lambda s, f: term.append(time.time()))
        print("up", flush=True)
        while not term or time.time() < term[0] + 3:
            time.sleep(0.1)
        print("saved", round(time.time() - term[0], 1), flush=True)
        ' > {log} 2>&1
        """
    job = submit(pbs_server, d, job_script(body, "-l walltime=00:02:00", "-l select=1:ncpus=1", "-r y"))
    wait_for_text(log, "up", 30)
    pbs_server.check("qdel", job)
    info = pbs_server.wait_job(job, timeout=pbs_server.kill_delay_s + 10)
    assert "saved 3." in log.read_text()  # ran on for 3 s after SIGTERM, then ended by itself
    # terminated (qdel); PBS records 256 + SIGTERM however the job then ended
    assert (info["substate"], info["Exit_status"]) == (91, 271), info
    queues = json.loads(pbs_server.check("qstat", "-Q", "-f", "-F", "json"))["Queue"]
    assert (queues["workq"]["kill_delay"], queues["short"]["kill_delay"]) == (20, 1)


def test_qrerun_shows_substate_rerun_and_runs_the_same_job_again(pbs_server: PbsServer) -> None:
    """What termination_cause reads: inside the job, after qrerun's SIGTERM, PBS's record of the
    job says substate RERUN (60); then PBS runs the same job id again."""
    d = user_dir(pbs_server, "rerun")
    log = d / "log.txt"
    body = f"""\
        exec python3 -u -c '
        import json, os, signal, subprocess, time
        term = []
        signal.signal(signal.SIGTERM, lambda s, f: term.append(1))
        with open("{log}", "a") as f:
            print("run", time.time(), file=f)
        while not term:
            time.sleep(0.1)
        out = subprocess.run(["qstat", "-f", "-F", "json", os.environ["PBS_JOBID"]], capture_output=True, text=True)
        job = next(iter(json.loads(out.stdout)["Jobs"].values())) if out.returncode == 0 else {{}}
        with open("{log}", "a") as f:
            print("term", job.get("substate"), job.get("run_count"), out.stderr.strip(), file=f)
        '
        """
    job = submit(pbs_server, d, job_script(body, "-l walltime=00:05:00", "-l select=1:ncpus=1", "-r y"))
    wait_for_text(log, "run", 30)
    # a job the server still sees starting (substate PRERUN) is requeued without a signal
    deadline = time.monotonic() + 30
    while pbs_server.job(job)["substate"] != 42 and time.monotonic() < deadline:
        time.sleep(0.1)
    pbs_server.check("qrerun", job, as_user=False)  # qrerun needs a manager (root)
    text = wait_for_text(log, "term ", 30)
    assert "term 60 1" in text, text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and log.read_text().count("run ") < 2:
        time.sleep(0.2)
    assert log.read_text().count("run ") == 2
    assert pbs_server.job(job)["run_count"] == 2
    pbs_server.qdel(job)


def test_two_nodes_one_process_per_node_through_pbsdsh_and_mpiexec(pbs_server_2nodes: PbsServer) -> None:
    d = user_dir(pbs_server_2nodes, "twonode")
    out, dsh = d / "out.txt", d / "pbsdsh.txt"
    # TM tasks write to the job's own output, not to the batch shell's redirection
    body = f"""\
        {{
        echo "head $(hostname)"; cat "$PBS_NODEFILE"
        pbsdsh -- /bin/sh -c 'echo "pbsdsh $(hostname) $PBS_NODENUM" >> {dsh}'
        mpiexec -n 2 --ppn 1 /bin/sh -c 'echo "mpiexec $(hostname) $PMI_RANK $PBS_JOBID"'
        }} > {out} 2>&1
        """
    job = submit(
        pbs_server_2nodes,
        d,
        job_script(body, "-l walltime=00:01:00", "-l select=2:ncpus=1:mpiprocs=1", "-l place=scatter"),
        "-W",
        "block=true",
    )
    lines = out.read_text().splitlines()
    assert lines[:3] == ["head pbsn1", "pbsn1", "pbsn2"], lines
    assert sorted(dsh.read_text().splitlines()) == ["pbsdsh pbsn1 0", "pbsdsh pbsn2 1"]
    assert sorted(x for x in lines if x.startswith("mpiexec")) == [
        f"mpiexec pbsn1 0 {job}",
        f"mpiexec pbsn2 1 {job}",
    ]


def test_host_selection_places_a_job_on_the_named_node(pbs_server_2nodes: PbsServer) -> None:
    d = user_dir(pbs_server_2nodes, "host")
    job = submit(
        pbs_server_2nodes,
        d,
        job_script("true", "-l walltime=00:01:00", "-l select=1:ncpus=1:host=pbsn2"),
        "-W",
        "block=true",
    )
    assert pbs_server_2nodes.wait_job(job, timeout=10)["exec_host"].startswith("pbsn2/")
