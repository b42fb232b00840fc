"""squeue/sacct JSON -> our states, in Slurm 22.05's format (what CI's cluster runs) and in the
newer one (lists of state flags, {"set", "number"} integers). The cluster tests check the 22.05
path against a real slurmdbd; these pin the shapes a newer cluster returns."""

from __future__ import annotations

import json

import pytest

from hpclaunch.schedulers.protocol import JobState
from hpclaunch.schedulers.slurm import parse_sacct_json, parse_squeue_json

pytestmark = pytest.mark.fast


def num(n: int) -> dict[str, object]:
    return {"set": True, "infinite": False, "number": n}


def test_squeue_2205_and_newer_shapes() -> None:
    old = {"jobs": [{"job_id": 7, "job_state": "PREEMPTED", "state_reason": "None"}]}
    new = {"jobs": [{"job_id": num(7), "job_state": ["TIMEOUT", "REQUEUED"], "state_reason": "None"}]}
    assert parse_squeue_json(json.dumps(old), "7").state is JobState.PREEMPTED  # type: ignore[union-attr]
    got = parse_squeue_json(json.dumps(new), "7")
    assert got is not None and (got.state, got.raw) == (JobState.TIMEOUT, "TIMEOUT")
    assert parse_squeue_json(json.dumps(old), "8") is None


def test_squeue_array_task_matches_on_the_task_not_the_job_id() -> None:
    data = {
        "jobs": [
            {"job_id": 11, "array_job_id": 10, "array_task_id": 1, "job_state": "RUNNING"},
            {"job_id": 10, "array_job_id": 10, "array_task_id": 0, "job_state": "NODE_FAIL"},
        ]
    }
    got = parse_squeue_json(json.dumps(data), "10_0")
    assert got is not None and got.state is JobState.NODE_FAIL


def record(
    job_id: int, state: object, start: int, task: object = None, array_id: int = 0
) -> dict[str, object]:
    return {
        "job_id": job_id,
        "array": {"job_id": array_id, "task_id": task},
        "state": state,
        "time": {"start": start, "submission": start - 1},
    }


def test_sacct_takes_the_latest_run_of_a_requeued_job_and_counts_requeues() -> None:
    # sacct lists one record per run; ordered here so that "last in the list" would be wrong.
    data = {
        "jobs": [
            record(5, {"current": "COMPLETED", "reason": "None"}, start=300),
            record(5, {"current": "REQUEUED", "reason": "None"}, start=100),
            record(5, {"current": "REQUEUED", "reason": "None"}, start=200),
        ]
    }
    got = parse_sacct_json(json.dumps(data), "5")
    assert got is not None
    assert (got.state, got.raw, got.reason) == (JobState.COMPLETED, "COMPLETED", "requeued 2x (sacct)")


def test_sacct_newer_shapes_and_array_tasks() -> None:
    data = {
        "jobs": [
            record(21, {"current": ["OUT_OF_MEMORY"], "reason": "None"}, start=5, task=num(1), array_id=20),
            record(20, {"current": ["DEADLINE"], "reason": "None"}, start=5, task=num(0), array_id=20),
        ]
    }
    got = parse_sacct_json(json.dumps(data), "20_1")
    assert got is not None and (got.state, got.raw) == (JobState.FAILED, "OUT_OF_MEMORY")
    got = parse_sacct_json(json.dumps(data), "20_0")
    assert got is not None and (got.state, got.raw) == (JobState.TIMEOUT, "DEADLINE")
    assert parse_sacct_json(json.dumps(data), "20_2") is None


def test_an_unknown_state_word_is_kept_not_guessed() -> None:
    data = {"jobs": [record(9, {"current": "SOMETHING_NEW", "reason": "Weird"}, start=1)]}
    got = parse_sacct_json(json.dumps(data), "9")
    assert got is not None and (got.state, got.raw, got.reason) == (
        JobState.UNKNOWN,
        "SOMETHING_NEW",
        "Weird",
    )
