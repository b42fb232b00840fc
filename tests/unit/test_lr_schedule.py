"""The LR on "train it further" (issue 46, item 2): a run stopped at step 422 with lr 2.88e-04,
resumed with --set train.steps=500, logged lr 4.34e-05 at step 430 (a 6.6x drop) and said nothing.

The rule (docs/runs.md, "Training further"): by default the schedule keeps the length the run had
(``train.lr_schedule_on_resume: keep``, the LR continues where it was; past the old length it stays
at its floor); ``stretch`` fits it to the new length. Either is said in one line at submit, in the
ledger and in status."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from hpclaunch.cli import main
from hpclaunch.config import RunConfig, TrainConfig, load_config
from hpclaunch.lr_schedule import lr_at, pinned_length, resume_change, schedule_length
from hpclaunch.orchestrator.launch import resumed_config
from hpclaunch.rundir import RunPaths, read_config

pytestmark = pytest.mark.fast

RECORDED = Path(__file__).parent / "recorded" / "requeued_run"  # a finished local run, 120 steps


def train(**keys: Any) -> TrainConfig:
    return TrainConfig.model_validate({"lr": 3e-4, "warmup_steps": 10, "min_lr_ratio": 0.1, **keys})


def test_the_schedule_ends_at_its_length_and_stays_at_its_floor() -> None:
    t = train(steps=500, lr_schedule_steps=100)
    assert schedule_length(t) == 100 and schedule_length(train(steps=500)) == 500
    assert lr_at(10, t) == pytest.approx(3e-4)
    assert lr_at(55, t) == pytest.approx(3e-5 + 2.7e-4 * 0.5)  # half way down its 100 steps
    assert [lr_at(s, t) for s in (100, 101, 500)] == pytest.approx([3e-5] * 3)  # the floor past it
    with pytest.raises(ValueError, match=r"must be smaller than train\.lr_schedule_steps=10"):
        train(steps=500, lr_schedule_steps=10)


def _the_issues_run() -> tuple[RunConfig, int]:
    """A run whose lr at step 422 is 2.88e-04 (3017 steps of cosine after 10 of warmup)."""
    cfg = load_config(None, ["train.steps=3017", "train.warmup_steps=10"])
    assert lr_at(422, cfg.train) == pytest.approx(2.88e-4, rel=2e-3)
    return cfg, 423


def test_keep_continues_the_lr_and_says_what_stretch_would_do() -> None:
    old, first = _the_issues_run()
    new = load_config(None, ["train.steps=500", "train.warmup_steps=10"])
    pin = pinned_length(old.train, new.train, ["train.steps=500"])
    assert pin == "train.lr_schedule_steps=3017"
    kept = load_config(None, ["train.steps=500", "train.warmup_steps=10", pin])
    assert lr_at(first, kept.train) == lr_at(first, old.train)  # no jump at the resume
    change = resume_change(old, kept, step=first)
    assert change is not None
    assert change.line() == (
        "resume: train.steps 3017 -> 500 from step 423; the LR schedule keeps its 3017 steps, lr 0.000288 at "
        "step 423 (train.lr_schedule_on_resume: keep; stretch: lr 4.61e-05 at step 423)"
    )


def test_stretch_fits_the_schedule_to_the_new_length_and_says_the_drop() -> None:
    old, first = _the_issues_run()
    sets = ["train.steps=500", "train.warmup_steps=10", "train.lr_schedule_on_resume=stretch"]
    new = load_config(None, sets)
    assert pinned_length(old.train, new.train, sets) is None  # nothing pinned: the length is train.steps
    assert lr_at(430, new.train) == pytest.approx(4.34e-5, rel=2e-3)  # the issue's 6.6x drop, by choice
    change = resume_change(old, new, step=first)
    assert change is not None and change.length_after == 500
    assert change.line() == (
        "resume: train.steps 3017 -> 500 from step 423; the LR schedule spans 3017 -> 500 steps, lr at step "
        "423 0.000288 -> 4.61e-05 (train.lr_schedule_on_resume: stretch; keep: lr 0.000288 at step 423)"
    )
    # a run pinned by an earlier keep is freed by stretch
    pinned = ["train.steps=600", "train.lr_schedule_steps=200"]
    again = load_config(None, [*pinned, *sets])  # the pinned run's config with this resume's --set
    assert pinned_length(load_config(None, pinned).train, again.train, sets) == "train.lr_schedule_steps=null"


def test_a_length_the_user_gives_and_an_unchanged_length_are_left_alone() -> None:
    old, first = _the_issues_run()
    mine = ["train.steps=500", "train.lr_schedule_steps=450"]
    assert pinned_length(old.train, load_config(None, mine).train, mine) is None
    same = load_config(None, ["train.steps=3017", "train.warmup_steps=10"])
    assert pinned_length(old.train, same.train, []) is None
    assert resume_change(old, same, step=first) is None  # nothing changed: nothing said


def test_a_resume_from_the_config_file_keeps_the_length_an_earlier_resume_pinned() -> None:
    """``train CONFIG --resume``: the file lacks the pin that ``train RUN --resume`` recorded (20 of
    60 steps); the length is compared, not the key, so the schedule does not jump to 60."""
    recorded = load_config(None, ["train.steps=60", "train.lr_schedule_steps=20", "train.warmup_steps=2"])
    from_file = load_config(None, ["train.steps=60", "train.warmup_steps=2"])
    assert pinned_length(recorded.train, from_file.train, ["train.steps=60"]) == "train.lr_schedule_steps=20"
    stretch = ["train.steps=60", "train.warmup_steps=2", "train.lr_schedule_on_resume=stretch"]
    # steps unchanged: the run's length, whatever the rule (stretch fits only a new train.steps)
    assert pinned_length(recorded.train, load_config(None, stretch).train, []) == "train.lr_schedule_steps=20"


def test_a_changed_global_batch_is_said() -> None:
    old, first = _the_issues_run()
    new = load_config(None, ["train.steps=3017", "train.warmup_steps=10", "train.global_batch=32"])
    change = resume_change(old, new, step=first)
    assert change is not None
    assert change.line() == (
        "resume: the LR schedule keeps its 3017 steps, lr 0.000288 at step 423; train.global_batch 16 -> 32 "
        "from step 423 (samples per step; the LR is not rescaled with it)"
    )


def test_past_the_end_of_a_kept_schedule_the_line_says_it_is_the_floor(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    cfg = resumed_config(RunPaths(run), ["train.steps=400"])
    assert cfg.train.lr_schedule_steps == 120  # the recorded run's own length, pinned
    change = resume_change(read_config(RunPaths(run)), cfg, step=121)
    assert change is not None
    assert (
        "the LR schedule keeps its 120 steps, lr 0.0001 at step 121 (its floor: past the schedule's end)"
        in (change.line())
    )
    stretched = resumed_config(RunPaths(run), ["train.steps=400", "train.lr_schedule_on_resume=stretch"])
    assert stretched.train.lr_schedule_steps is None and schedule_length(stretched.train) == 400


def test_submit_resume_says_it_records_it_and_status_shows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole path with the scheduler faked: `submit --resume RUN --set train.steps=N` prints the
    line, the ledger holds it (schedule_changed), `status` (text and --json) shows it."""
    from hpclaunch.orchestrator import launch
    from hpclaunch.schedulers.protocol import RenderedJob

    run = tmp_path / "run"
    shutil.copytree(RECORDED, run)
    (run / "checkpoints" / "step_000120").mkdir(parents=True)  # the finished run's last checkpoint

    class Local:
        kind = "local"

        def render(self, plan: Any) -> RenderedJob:
            return RenderedJob(text="#!/bin/bash\n", filename="job.local.sh")

        def submit(self, plan: Any, rendered: RenderedJob) -> str:
            return "local1"

        def status(self, paths: RunPaths, job_id: str) -> Any:
            raise ValueError("no such job here")

    monkeypatch.setattr(launch, "get_scheduler", lambda kind: Local())
    monkeypatch.setattr("hpclaunch.orchestrator.login_flow.refuse_if_locked", lambda plan: None)
    # (the recording's config names the directory it was recorded in: here is elsewhere)
    args = ["--set", f"run_dir={run}", "--set", "train.steps=400", "--no-preflight"]
    assert main(["submit", "--resume", str(run), *args]) == 0
    out = capsys.readouterr().out
    line = (
        "resume: train.steps 120 -> 400 from step 121; the LR schedule keeps its 120 steps, lr 0.0001 at "
        "step 121 (its floor: past the schedule's end) (train.lr_schedule_on_resume: keep; stretch: lr "
    )
    assert line in out, out
    recorded = [
        json.loads(x)
        for f in (run / "events").glob("cli-*.jsonl")
        for x in f.read_text().splitlines()
        if json.loads(x)["event"] == "schedule_changed"
    ]
    assert len(recorded) == 1 and recorded[0]["step"] == 121 and recorded[0]["length_after"] == 120
    assert read_config(RunPaths(run)).train.lr_schedule_steps == 120  # what the trainer will read
    assert main(["status", str(run), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["schedule_changes"]
    assert len(shown) == 1 and shown[0].startswith(line)
    assert main(["status", str(run)]) == 0
    assert "resume: train.steps 120 -> 400 from step 121" in capsys.readouterr().out


def test_a_run_moved_or_copied_is_resumed_where_it_is_now(tmp_path: Path) -> None:
    """Its config.yaml names the directory it was started in (/tmp/w19/runs/c1 here): a resume of
    the copy trains the copy, not the original (it did, from scratch where the original was gone)."""
    from hpclaunch.errors import UserInputError
    from hpclaunch.orchestrator.launch import load_existing_run

    copy = tmp_path / "elsewhere" / "c1-copy"
    shutil.copytree(RECORDED, copy)
    assert "/tmp/w19/runs/c1" in (copy / "config.yaml").read_text()
    cfg = load_existing_run(copy, ["train.steps=400"])
    assert cfg.run_path() == copy.resolve() and read_config(RunPaths(copy)).run_path() == copy.resolve()
    with pytest.raises(UserInputError, match="run_dir cannot be set with it"):
        load_existing_run(copy, ["run_dir=/tmp/somewhere"])
