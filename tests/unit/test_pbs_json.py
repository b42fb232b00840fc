"""PBS JSON -> our states, on records captured from the real OpenPBS 23.06 of scripts/local-pbs
(tests/unit/pbs_records) plus small edits of them for states that are hard to catch live."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.schedulers.pbs_json import (
    find_job,
    parse_duration,
    parse_jobs,
    parse_nodes,
    parse_queues,
    parse_server,
)
from hpclaunch.schedulers.protocol import JobState

pytestmark = pytest.mark.fast

DATA = Path(__file__).parent / "pbs_records"


def record(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / name).read_text())
    return data


def status(data: dict[str, Any]) -> tuple[JobState, str, str]:
    (job,) = parse_jobs(json.dumps(data)).values()
    s = job.status()
    return s.state, s.raw, s.reason


def edited(name: str, **attrs: Any) -> dict[str, Any]:
    data = record(name)
    (attrs_of_job,) = data["Jobs"].values()
    for key, value in attrs.items():
        if value is None:
            attrs_of_job.pop(key, None)
        else:
            attrs_of_job[key] = value
    return data


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("job-finished-2nodes.json", (JobState.COMPLETED, "F/92", "")),
        ("job-walltime.json", (JobState.TIMEOUT, "F/93", "killed by PBS: it exceeded its walltime")),
        (
            "job-qdel-after-run.json",
            (JobState.CANCELLED, "F/91", "deleted (qdel) after it ran (exit status 271)"),
        ),
        ("job-qdel-held.json", (JobState.CANCELLED, "F/91", "deleted (qdel)")),
        ("job-subjob.json", (JobState.COMPLETED, "F/92", "")),
        ("job-array.json", (JobState.COMPLETED, "F/92", "")),
        ("held.json", (JobState.HELD, "H/20", "held (user hold; qrls releases it)")),
        (
            "depend.json",
            (JobState.PENDING, "H/22", "waiting for a dependency (afterany:37.pbshead@pbshead)"),
        ),
        ("running.json", (JobState.RUNNING, "R/41", "")),
    ],
)
def test_captured_states(name: str, expected: tuple[JobState, str, str]) -> None:
    assert status(record(name)) == expected


def test_states_that_are_hard_to_catch_live() -> None:
    assert status(edited("running.json", substate=60))[0] is JobState.REQUEUED  # qrerun in progress
    assert status(edited("running.json", job_state="S", substate=43))[0] is JobState.SUSPENDED
    assert status(edited("running.json", job_state="E", substate=51)) == (JobState.RUNNING, "E/51", "exiting")
    assert status(edited("running.json", job_state="Q", substate=10)) == (JobState.PENDING, "Q/10", "queued")
    failed = edited("job-walltime.json", Exit_status=3)
    assert status(failed) == (JobState.FAILED, "F/93", "exit status 3")
    mem = edited("job-walltime.json", Exit_status=-27)
    assert status(mem) == (JobState.FAILED, "F/93", "ended by PBS: exceeded its mem")
    killed = edited("job-walltime.json", Exit_status=265)
    assert status(killed)[2] == "killed by signal 9"
    # a subjob that has ended is X in the listing without -x
    assert status(edited("job-subjob.json", job_state="X"))[0] is JobState.COMPLETED
    # operator hold, no dependency
    assert (
        status(edited("held.json", Hold_Types="o", depend=None))[2]
        == "held (operator hold; qrls releases it)"
    )


def test_job_fields_and_lookup_with_or_without_the_server_suffix() -> None:
    jobs = parse_jobs((DATA / "job-finished-2nodes.json").read_text())
    job = find_job(jobs, "12")
    assert job is not None and job.exec_hosts == ("pbsn1", "pbsn2") and job.run_count == 1
    sub = find_job(parse_jobs((DATA / "job-subjob.json").read_text()), "18[0].pbshead")
    assert sub is not None and (sub.array_id, sub.array_index) == ("18[].pbshead", 0)
    assert find_job(jobs, "13") is None
    rerun = next(iter(parse_jobs(json.dumps(edited("running.json", substate=61))).values()))
    assert rerun.rerun_in_progress


def test_queues_server_and_nodes() -> None:
    queues = parse_queues((DATA / "queues.json").read_text())
    assert list(queues) == ["workq", "short"]
    assert (queues["workq"].kill_delay_s, queues["workq"].max_walltime_s) == (10, None)
    assert (queues["short"].kill_delay_s, queues["short"].max_walltime_s) == (1, 300)
    server = parse_server((DATA / "server.json").read_text())
    assert server["default_queue"] == "workq"
    nodes = parse_nodes((DATA / "nodes.json").read_text())
    node = nodes["pbshead"]
    assert (node.count("ncpus"), node.count("ngpus"), node.host, node.usable) == (8, 2, "pbshead", True)


def test_durations_and_bad_input() -> None:
    assert [parse_duration(x) for x in ("00:05:00", "90", "1:30", 45, "", None, "x")] == [
        300,
        90,
        90,
        45,
        None,
        None,
        None,
    ]
    with pytest.raises(ValueError, match="not PBS JSON"):
        parse_jobs("qstat: Unknown Job Id 9")
