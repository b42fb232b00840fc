"""The preflight runner and report: concurrency, per-check timeouts, crashes, JSON shape, --only."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from rich.console import Console

from hpclaunch.config import RunConfig
from hpclaunch.errors import UserInputError
from hpclaunch.preflight import LOGIN_CHECKS, NODE_CHECKS, Report, Status, print_report, run_login_checks
from hpclaunch.preflight.check_context import CheckContext, Findings, Outcome
from hpclaunch.preflight.probe import Probe, ProbeError, StaticProbe, send_request
from hpclaunch.preflight.results import CheckResult
from hpclaunch.preflight.runner import Check, run_checks, select
from hpclaunch.schedulers.protocol import NodeContextError


def ctx() -> CheckContext:
    return CheckContext(cfg=RunConfig(), node=None, probe=StaticProbe())


def sleeper(seconds: float, status: Status = Status.PASS):
    def check(_: CheckContext) -> Outcome:
        time.sleep(seconds)
        return Outcome(status, f"slept {seconds}")

    return check


def test_checks_run_concurrently() -> None:
    checks = [Check(f"c{i}", sleeper(0.4), timeout_s=5) for i in range(5)]
    start = time.monotonic()
    report = run_checks(checks, ctx(), where="login")
    assert time.monotonic() - start < 1.5  # 5 x 0.4 s one after the other would be 2 s
    assert [c.name for c in report.checks] == [f"c{i}" for i in range(5)]
    assert report.ok and not report.failed


def test_timeout_and_crash_become_fail_findings() -> None:
    release = threading.Event()

    def hangs(_: CheckContext) -> Outcome:
        release.wait(10)
        return Outcome(Status.PASS, "late")

    def crashes(_: CheckContext) -> Outcome:
        raise ZeroDivisionError("boom")

    def typed(_: CheckContext) -> Outcome:
        raise NodeContextError("SLURM_NODEID is not set", hint="inside the job?")

    checks = [
        Check("hang", hangs, timeout_s=0.3),
        Check("crash", crashes, timeout_s=5),
        Check("typed", typed, timeout_s=5),
        Check("fine", sleeper(0), timeout_s=5),
    ]
    start = time.monotonic()
    report = run_checks(checks, ctx(), where="login")
    release.set()
    assert time.monotonic() - start < 2
    assert [c.status for c in report.checks] == [Status.FAIL, Status.FAIL, Status.FAIL, Status.PASS]
    assert "did not finish within 0.3 s" in report.get("hang").finding
    assert "ZeroDivisionError: boom" in report.get("crash").finding
    assert (
        report.get("typed").finding == "SLURM_NODEID is not set"
        and report.get("typed").hint == "inside the job?"
    )
    assert [c.name for c in report.failed] == ["hang", "crash", "typed"]


def test_status_is_a_string_for_callers() -> None:
    r = CheckResult("x", Status.FAIL, "bad")
    assert r.status == "fail" and str(r.status) == "fail" and json.dumps(r.status) == '"fail"'


def test_report_json_and_table() -> None:
    report = Report(
        [
            CheckResult("env", Status.PASS, "ok", None, 0.5),
            CheckResult("data", Status.FAIL, "missing", "fix", 0.1),
        ],
        1.234,
    )
    data = json.loads(json.dumps(report.to_json()))
    assert data == {
        "ok": False,
        "checks": [
            {"name": "env", "status": "pass", "finding": "ok", "hint": None, "seconds": 0.5},
            {"name": "data", "status": "fail", "finding": "missing", "hint": "fix", "seconds": 0.1},
        ],
        "seconds": 1.234,
    }
    console = Console(record=True, width=120, force_terminal=True)
    print_report(report, console=console)
    text = console.export_text()
    assert "missing" in text and "FAILED: 1 pass, 1 fail" in text and "┃ check" in text


def test_the_report_in_a_file_or_a_pipe_fits_a_log() -> None:
    """Issue 46: written to a file, the table's rows were padded to ~600 characters."""
    import io

    long = "x" * 300
    report = Report(
        [
            CheckResult("env", Status.PASS, "ok", None, 0.5),
            CheckResult("scheduler", Status.WARN, long, "do y"),
        ],
        1.0,
    )
    out = io.StringIO()
    print_report(report, console=Console(file=out, width=1000))  # a pipe: not a terminal
    assert out.getvalue().splitlines() == [
        "preflight (login)",
        "  env        pass  ok",
        f"  scheduler  warn  {long}",
        "                   hint: do y",
        "preflight (login) ok: 1 pass, 1 warn in 1.0 s",
    ]


def test_findings_worst_wins_and_pass_line_names_skips() -> None:
    f = Findings()
    f.ok("a fine")
    f.skip("b not here")
    assert f.outcome() == Outcome(Status.PASS, "a fine; b not here")
    f.warn("c odd", "look")
    f.warn("d odd too")
    assert f.outcome() == Outcome(Status.WARN, "c odd; d odd too", "look")
    f.fail("e broken", "fix e")
    assert f.outcome() == Outcome(Status.FAIL, "e broken", "fix e")
    assert Findings().outcome().status is Status.SKIP


def test_only_selects_and_refuses_unknown_names() -> None:
    assert [c.name for c in select(LOGIN_CHECKS, {"disk", "data"}, where="login")] == ["data", "disk"]
    with pytest.raises(UserInputError, match="did you mean disk"):
        select(LOGIN_CHECKS, {"dsk"}, where="login")
    with pytest.raises(UserInputError, match="unknown login check 'node'"):
        select(LOGIN_CHECKS, {"node"}, where="login")
    assert "node" in NODE_CHECKS and "scheduler" not in NODE_CHECKS
    with pytest.raises(UserInputError):
        run_login_checks(RunConfig(), only={"nope"})


def test_selected_checks_without_probe_do_not_start_one() -> None:
    report = run_login_checks(RunConfig(), only={"scheduler"})
    assert [c.name for c in report.checks] == ["scheduler"]
    assert report.checks[0].status is Status.SKIP
    assert report.seconds < 1


# ---- the probe subprocess (without torch: fake interpreters) --------------------------------


def test_probe_missing_interpreter() -> None:
    probe = Probe(None, model=None, timeout_s=5)
    with pytest.raises(ProbeError, match="not found"):
        probe.result()


def test_probe_failing_interpreter(tmp_path) -> None:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\necho 'ImportError: no module named json' >&2\nexit 1\n")
    script.chmod(0o755)
    with pytest.raises(ProbeError, match="failed: ImportError"):
        Probe(str(script), model=None, timeout_s=5).result()


def test_a_probe_that_closed_its_stdin_still_reports_its_failure(tmp_path) -> None:
    # The race CI once lost: the broken interpreter exits before the request is written, the
    # flush on close() raises BrokenPipeError and leaves a closed file that communicate() tripped
    # on (ValueError). Here the probe closes its stdin before the request is sent, every time.
    proc = subprocess.Popen(
        ["sh", "-c", "exec 0<&-; echo ready; read _ 2>/dev/null; echo 'ImportError: x' >&2; exit 1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    send_request(proc, "x" * 400)
    assert proc.stdin is None
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 1 and "ImportError" in err


def test_probe_timeout_kills_it(tmp_path) -> None:
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    probe = Probe(str(script), model=None, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(ProbeError, match=r"no answer within 0\.5 s"):
        probe.result()
    assert time.monotonic() - start < 3
    assert probe._proc is not None and probe._proc.poll() is not None


def test_probe_reads_last_json_line(tmp_path) -> None:
    script = tmp_path / "python"
    script.write_text('#!/bin/sh\ncat >/dev/null\necho "warning: noise"\necho \'{"python": "3.12.1"}\'\n')
    script.chmod(0o755)
    assert Probe(str(script), model={"depth": 1}, timeout_s=5).result() == {"python": "3.12.1"}
