"""The attempt contract (``rundir.cause``, ``rundir.clock``): one vocabulary of causes, one clock,
one stop-lead rule, read the same by the trainer, the script lint, preflight and the accounting;
and run directories written before the contract existed still read."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
from tests.runlib import hpclaunch

from hpclaunch.config import load_config
from hpclaunch.orchestrator.plan_build import build
from hpclaunch.preflight.check_context import CheckContext, StaticProbe
from hpclaunch.preflight.layout import check_config
from hpclaunch.rank.stop import StopController
from hpclaunch.rundir.cause import STOP_CAUSES, Cause, UnknownCause
from hpclaunch.rundir.clock import AttemptClock, allocation_start, attempt_end, stop_lead_s
from hpclaunch.rundir.events import Started, parse_event
from hpclaunch.templates.lint import lint_slurm

pytestmark = pytest.mark.fast

SRC = Path(__file__).resolve().parents[2] / "src" / "hpclaunch"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAUSE_VALUES = {c.value for c in Cause}


# ---- one vocabulary of causes -------------------------------------------------------------------


def test_an_unknown_cause_is_an_error_never_a_guess() -> None:
    assert Cause.parse("timeout") is Cause.TIMEOUT and Cause.parse(" Preemption ") is Cause.PREEMPTION
    with pytest.raises(UnknownCause, match="unknown cause 'evicted'"):
        Cause.parse("evicted")  # it used to become a user stop
    assert Cause.parse_optional(None) is None and Cause.parse_optional("") is None


def test_causes_serialize_as_their_recorded_values() -> None:
    assert json.dumps({"cause": Cause.NODE_FAILURE}) == '{"cause": "node_failure"}'
    assert f"{Cause.HANG}" == "hang" and str(Cause.USER) == "user"
    assert {Cause.TIMEOUT: 4}.get("timeout") == 4  # a str key finds it (ledgers are read as str)


def test_every_cause_has_one_budget_or_none() -> None:
    assert {c for c in Cause if c.budget == "requeue"} == set(STOP_CAUSES)
    assert {c for c in Cause if c.budget == "crash"} == {Cause.CRASH, Cause.FILESYSTEM}
    assert Cause.HANG.budget == "hang" and Cause.NODE_FAILURE.budget == "node"
    assert {c for c in Cause if c.budget is None} == {Cause.CANCELLED, Cause.TRAINING, Cause.DATA}


def _cause_literals(path: Path) -> list[str]:
    """String constants equal to a cause value, where they stand *as a cause*: a ``cause=``
    keyword, a comparison with something named ``cause``, a ``return`` of a ``*cause*`` function,
    the cause argument of ``Decision(...)``, a key or value of a ``*CAUSE*`` table."""
    tree = ast.parse(path.read_text())
    found: list[str] = []

    def is_cause_literal(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in CAUSE_VALUES

    def names_cause(node: ast.AST) -> bool:
        return "cause" in ast.unparse(node).lower()

    def where(node: ast.AST) -> str:
        return f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:80]}"

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.keyword)
            and node.arg
            and "cause" in node.arg
            and is_cause_literal(node.value)
        ):
            found.append(where(node.value))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(names_cause(s) for s in sides) and any(
                is_cause_literal(s)
                or (isinstance(s, (ast.Tuple, ast.Set, ast.List)) and any(map(is_cause_literal, s.elts)))
                for s in sides
            ):
                found.append(where(node))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "cause" in node.name:
            found += [
                where(r)
                for r in ast.walk(node)
                if isinstance(r, ast.Return) and r.value is not None and is_cause_literal(r.value)
            ]
        elif (
            isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Decision") and len(node.args) > 1
        ):
            if is_cause_literal(node.args[1]):
                found.append(where(node))
        elif isinstance(node, ast.Assign) and any("CAUSE" in ast.unparse(t) for t in node.targets):
            if isinstance(node.value, ast.Dict) and any(is_cause_literal(k) for k in node.value.keys if k):
                found.append(where(node))
            if isinstance(node.value, ast.Tuple) and any(map(is_cause_literal, node.value.elts)):
                found.append(where(node))
    return found


def test_cause_strings_live_only_in_the_enum() -> None:
    """Causes appear in the code as ``Cause`` members; their strings only in ``rundir/cause.py``
    (and what the ledger and outcome files hold)."""
    found = [
        hit for path in sorted(SRC.rglob("*.py")) if path.name != "cause.py" for hit in _cause_literals(path)
    ]
    assert found == []


def test_the_literal_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The check above can fail: each form it looks for, once."""
    bad = SRC / "_probe_for_the_test.py"
    bad.write_text(
        "def f(e, ledger, Decision, Action):\n"
        "    ledger.append('requeued', cause='crash')\n"
        "    if e.get('cause') == 'hang':\n"
        "        return Decision(Action.END, 'user', 'x')\n"
        "def failure_cause(err):\n"
        "    return 'training'\n"
        "STOP_CAUSES = ('timeout', 'preemption')\n"
    )
    try:
        assert len(_cause_literals(bad)) == 5
    finally:
        bad.unlink()


# ---- one clock, one stop-lead rule --------------------------------------------------------------


def test_one_stop_lead_rule_and_one_end_time_computation_in_the_source() -> None:
    """``grep`` finds the rule once: the save slack and "start + limit" appear only in
    ``rundir/clock.py``; everything else calls it."""
    lead_rule = re.compile(r"(1\.5|SLACK)\s*\*\s*[\w.]*(save|checkpoint)")
    end_rule = re.compile(r"(start|now)\w*\s*\+\s*\w*(time_)?limit|limit\w*\s*\+\s*\w*start")
    hits = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "rundir" / "clock.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if lead_rule.search(code) or end_rule.search(code):
                hits.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert hits == []
    clock = (SRC / "rundir" / "clock.py").read_text()
    assert clock.count("def stop_lead_s(") == 1 and clock.count("def attempt_end(") == 1


def test_the_rule() -> None:
    assert stop_lead_s(fixed_s=30, save_s=100, margin_s=10) == 30
    assert stop_lead_s(fixed_s=None, save_s=20, margin_s=10) == 40
    assert stop_lead_s(fixed_s=None, save_s=20, margin_s=10, step_s=0.5, check_every=4) == 42
    assert attempt_end(start=100, limit_s=60) == 160
    assert attempt_end(start=100, limit_s=60, scheduler_end=155) == 155


def test_lint_preflight_and_the_trainer_use_one_lead(tmp_path: Path) -> None:
    """Before the contract these disagreed for the same config (no launch.stop_lead_s, a 20 s
    limit): lint checked the scheduler's warning lead (limit/5 = 5 s), preflight the estimated save
    + margin (12 s), the trainer 1.5 x a hard-coded 5 s + margin (17.5 s). Now one answer."""
    cfg = load_config(None, ["scheduler.time_limit=20s", f"run_dir={tmp_path / 'run'}"])
    plan = build(cfg, python="python3")
    lead = plan.planned_stop_lead_s
    assert lead == pytest.approx(1.5 * plan.save_estimate_s + cfg.launch.stop_margin_s)

    trainer = StopController(paths=None, clock=plan.attempt_clock(start=0.0, scheduler_end=None))
    assert trainer.lead_s == pytest.approx(lead)  # before any save or step is measured

    script = "#!/bin/bash\n#SBATCH --ntasks-per-node=1\n#SBATCH --open-mode=append\n#SBATCH --signal=USR2@5\n"
    linted = [f.message for f in lint_slurm(script, generated_lines=4, plan=plan)]
    said = [m for m in linted if "stop lead" in m]
    assert said and f"stop lead {lead:.0f} s" in said[0]

    finding = check_config(CheckContext(cfg=cfg, node=None, probe=StaticProbe(None))).finding
    assert f"the stop lead ({round(lead)} s)" in finding  # its warning: 20 s leaves no training


def test_the_clock_is_recorded_whole_and_read_back() -> None:
    clock = AttemptClock.build(
        start=1000.0,
        limit_s=120,
        scheduler_end=1110.0,
        warn_lead_s=24,
        stop_lead_fixed_s=None,
        margin_s=10,
        save_estimate_s=2.5,
    )
    assert AttemptClock.from_env(clock.to_env()) == clock
    assert AttemptClock.from_json(json.loads(json.dumps(clock.to_json()))) == clock
    assert clock.deadline() == 1110.0 - (1.5 * 2.5 + 10)

    def started(fields: dict[str, object]) -> Started:
        event = parse_event({"event": "started", **fields})
        assert isinstance(event, Started)
        return event

    assert allocation_start(started({"clock": clock.to_json()}), limit_s=999) == 1000.0
    # A run written before the clock was recorded: its end minus the limit the scheduler applied.
    assert allocation_start(started({"end_time": 1110.0}), limit_s=120) == 990.0
    assert allocation_start(started({}), limit_s=120) is None


# ---- old run directories still read -------------------------------------------------------------


@pytest.mark.spawns
def test_a_run_written_before_the_contract_reads_the_same(tmp_path: Path) -> None:
    """A local run (three attempts, two time-limit requeues) recorded by the code before this
    change: ``status`` tells the same story, figure for figure, and ``report`` draws it."""
    run = tmp_path / "old"
    shutil.copytree(FIXTURES / "run-before-the-attempt-contract", run)
    shown = json.loads(hpclaunch("status", str(run), "--json", cwd=tmp_path).stdout)
    shown.pop("run")
    expected = json.loads((FIXTURES / "run-before-the-attempt-contract.status.json").read_text())
    # Later keys (cost, in_place...) may be added, at the top and in each attempt; none changes.
    attempts = [
        {k: a.get(k) for k in e} for a, e in zip(shown["attempts"], expected["attempts"], strict=True)
    ]
    assert attempts == expected["attempts"]
    assert {k: shown.get(k) for k in expected if k != "attempts"} == {
        k: v for k, v in expected.items() if k != "attempts"
    }
    assert [a["cause"] for a in shown["attempts"]] == ["timeout", "timeout", None]
    hpclaunch("report", str(run), cwd=tmp_path)
    pngs = sorted(p.name for p in (run / "report").glob("*.png"))
    assert "loss.png" in pngs and (run / "report" / "index.html").stat().st_size > 10_000
