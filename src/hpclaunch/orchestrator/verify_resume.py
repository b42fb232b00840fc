"""``hpclaunch verify-resume``: prove on a user's own script that a resume is exact, or say where it
is not.

The script runs several times on this machine, through ``hpclaunch train`` (the real rank host,
gloo across processes), each with ``testing.trace_steps``: every rank records, for every step, its
random states at the step's start and end, each attached object's digest after it and what it
logged (``rank.run``), and at each attempt's start what it restored. The runs:

- ``reference``: uninterrupted, on ``ranks`` ranks;
- ``stop``: a user's stop after about a third of the steps, then ``train --resume``;
- ``crash``: the last rank dies after about two thirds (periodic saves before it), restarted in
  place by the node agent;
- ``ranks -> 1``: stopped like ``stop``, resumed on one rank.

The first two resumed runs must match the reference at every step and on every rank, bitwise; the
first difference is named (step, rank, what) with what usually causes it. At another world size the
data partition changes, so only the restore is compared: the parameters restored on one rank
equal those the ``ranks`` ranks saved, and every step after it is trained once. Torch-free: it
reads the traces the runs wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserInputError
from ..fsutil import read_jsonl
from ..rundir import RunPaths, read_events
from ..rundir.events import Resumed, of_kind

__all__ = ["SCENARIOS", "Finding", "Scenario", "VerifyPlan", "verify_resume"]

SCENARIOS = ("stop", "crash", "ranks")

Record = dict[str, Any]

# What a difference found first usually means (the report's hint).
USUAL_REASONS = {
    "restored": "{obj} is not what was saved at step {step}: part of it does not round-trip through its "
    "state_dict()/load_state_dict(), or the script changed it between attach() and the loop",
    "rng_after_restore": "the random state at the loop's start differs from the one saved: the script drew "
    "random numbers between attach() and its first step (a batch drawn before the loop, a dropout "
    "call, a shuffle); draw them inside the step",
    "rng_begin": "the random state at the start of step {step} differs: something drew random numbers "
    "before the step boundary (typically the next batch drawn at the end of the previous step, "
    "prefetched): draw each step's batch inside its step",
    "data": "the data position differs: the loader was iterated outside run.steps()' boundary, or the "
    "data object is not the one the script draws its batches from",
    "object": "{obj} differs after step {step} while the random state at its start was equal: state "
    "kept outside attach() (a scheduler, a counter, a buffer not attached) or a nondeterministic "
    "kernel",
    "logged": "what step {step} logged differs while the random state at its start and every attached "
    "object were equal: state kept outside attach(), or a nondeterministic kernel",
    "missing": "step {step} was never trained after the resume (lost)",
}


@dataclass
class Finding:
    scenario: str
    ok: bool
    summary: str  # one line
    step: int | None = None
    rank: int | None = None
    what: str | None = None  # rng_begin, objects.<name>, logged.<key>, restored.<name>, ...
    hint: str | None = None


@dataclass
class Scenario:
    name: str
    describe: str
    first: list[str]  # extra --set of the first run
    resume: list[str] | None  # extra --set of the resumed run (None: no resume run)
    bitwise: bool = True
    run: Path = field(default_factory=Path)

    @property
    def key(self) -> str:
        """The name ``--only`` takes: stop, crash, ranks."""
        return "ranks" if "->" in self.name else self.name


@dataclass
class VerifyPlan:
    script: Path
    config: list[Path]
    overrides: list[str]
    args: list[str]
    ranks: int
    work: Path
    only: frozenset[str] = frozenset()  # scenarios to run (stop, crash, ranks); empty: all
    timeout_s: float = 900.0


def verify_resume(plan: VerifyPlan, *, say: Any = print) -> list[Finding]:
    """Run the scenarios (the reference first: it tells the script's length) and compare them."""
    plan.work.mkdir(parents=True, exist_ok=True)
    ref = plan.work / "reference"
    say(f"reference: {plan.ranks} ranks, uninterrupted ...")
    _train(plan, ref, [], expect=(0,))
    total = _total(ref)
    if total < 3:
        raise UserInputError(
            f"the script trains {total} step(s) here: verify-resume needs at least 3",
            where="verify-resume",
            hint="give the script a step count after --, e.g. -- --steps 30",
        )
    stop_at, crash_at = max(1, total // 3), max(total // 3 + 1, (2 * total) // 3)
    every = f"checkpoint.every_steps={max(1, total // 6)}"
    scenarios = [
        Scenario(
            "stop", f"stopped after step {stop_at}, resumed", [every, f"testing.stop_at_step={stop_at}"], []
        ),
        Scenario(
            "crash",
            f"rank {plan.ranks - 1} killed after step {crash_at}, restarted in place",
            [every, f"testing.crash_at_step={crash_at}", "scheduler.max_failure_retries=1"],
            None,
        ),
    ]
    if plan.ranks > 1:
        scenarios.append(
            Scenario(
                f"{plan.ranks} -> 1 ranks",
                f"stopped after step {stop_at} on {plan.ranks} ranks, resumed on 1",
                [every, f"testing.stop_at_step={stop_at}"],
                ["scheduler.procs_per_node=1"],
                bitwise=False,
            )
        )
    if plan.only:
        scenarios = [sc for sc in scenarios if sc.key in plan.only]
    findings: list[Finding] = []
    reference = _traces(ref)
    for sc in scenarios:
        sc.run = plan.work / sc.name.replace(" ", "").replace(">", "")
        say(f"{sc.name}: {sc.describe} ...")
        _train(plan, sc.run, sc.first, expect=(0,) if sc.resume is None else (3,))
        if sc.resume is not None:
            _train(plan, sc.run, sc.resume, expect=(0,), resume=True)
        found = compare_bitwise(sc.name, reference, _traces(sc.run), total) if sc.bitwise else None
        findings.append(found or compare_restore(sc.name, _traces(sc.run), total))
    return findings


# ---- the runs ------------------------------------------------------------------------------------


def _train(
    plan: VerifyPlan, run: Path, extra: Sequence[str], *, expect: tuple[int, ...], resume: bool = False
) -> None:
    sets = [
        f"run_dir={run}",
        f"name={run.name}",
        "testing.trace_steps=true",
        f"scheduler.procs_per_node={plan.ranks}",
        "scheduler.gpus_per_node=0",
        *plan.overrides,
        *extra,
    ]
    head = [sys.executable, "-m", "hpclaunch", "train"]
    if resume:
        cmd = [*head, str(run), "--resume", *_sets(sets)]
    else:
        cmd = [*head, *map(str, plan.config), "--script", str(plan.script), *_sets(sets), "--", *plan.args]
    env = {**os.environ, "HPCLAUNCH_PROGRESS": "0"}
    log = run.parent / f"{run.name}{'-resumed' if resume else ''}.log"
    with open(log, "w") as out:
        try:
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=plan.timeout_s)
        except subprocess.TimeoutExpired:
            raise UserInputError(
                f"{run.name}: the script did not end within {plan.timeout_s:.0f} s", where=str(log)
            ) from None
    if done.returncode not in expect:
        tail = " | ".join(log.read_text().strip().splitlines()[-3:])
        raise UserInputError(
            f"{run.name}: hpclaunch train exited {done.returncode} (expected {' or '.join(map(str, expect))}): {tail}",
            where=str(log),
            hint="the whole output is in the log named above",
        )


def _sets(items: Sequence[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _total(run: Path) -> int:
    said = [e.total_steps for e in of_kind(read_events(RunPaths(run)).events, Resumed) if e.total_steps]
    if not said:
        raise UserInputError(
            "the script never reached run.steps(total=...)", where=str(run), hint="see its log beside it"
        )
    return int(said[-1])


def _traces(run: Path) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = {}
    for path in sorted((run / "trace").glob("rank*.jsonl")):
        out[int(path.stem.removeprefix("rank"))] = read_jsonl(path)
    return out


# ---- the comparisons -----------------------------------------------------------------------------


def compare_bitwise(
    name: str, reference: dict[int, list[Record]], run: dict[int, list[Record]], total: int
) -> Finding:
    """The first difference between ``run`` and ``reference``, in the order the run met it."""
    ref_steps = {
        r: {rec["step"]: rec for rec in recs if rec["kind"] == "step"} for r, recs in reference.items()
    }
    if sorted(run) != sorted(reference):
        return Finding(name, False, f"ranks {sorted(run)} traced, the reference's were {sorted(reference)}")
    first: Finding | None = None
    for rank, records in sorted(run.items()):
        seeded = _seeded(reference[rank], records)
        for rec in records:
            found = _differs(name, rank, rec, ref_steps[rank], seeded)
            if found is not None and (first is None or (found.step or 0) < (first.step or 0)):
                first = found
                break
    if first is not None:
        return first
    missing = _missing(run, total)
    if missing is not None:
        return Finding(name, False, f"step {missing} was never trained", step=missing, what="missing",
                       hint=USUAL_REASONS["missing"].format(step=missing))  # fmt: skip
    resumed = [rec for rec in run[0] if rec["kind"] == "begin" and rec["step"]]
    froms = ", ".join(f"step {rec['step']} ({rec.get('resumed_from') or 'disk'})" for rec in resumed)
    again = sum(1 for rec in run[0] if rec["kind"] == "step") - total
    extra = f"; {again} step(s) computed again after the crash, equal too" if again > 0 else ""
    return Finding(
        name, True, f"bitwise equal at every step of {total} on every rank (resumed at {froms}){extra}"
    )


def _seeded(reference: list[Record], run: list[Record]) -> set[str]:
    """The generators the script seeds: equal at both runs' start, before anything was interrupted
    (one the script never seeds, e.g. Python's ``random``, starts anywhere and is not compared)."""
    a: dict[str, str] = next((rec["rng"] for rec in reference if rec["kind"] == "begin"), {})
    b: dict[str, str] = next((rec["rng"] for rec in run if rec["kind"] == "begin"), {})
    return {g for g, digest in a.items() if b.get(g) == digest}


def _rng_differs(a: dict[str, str], b: dict[str, str], seeded: set[str]) -> str | None:
    return next((g for g in sorted(seeded) if a.get(g) != b.get(g)), None)


def _differs(name: str, rank: int, rec: Record, ref: dict[int, Record], seeded: set[str]) -> Finding | None:
    step = int(rec["step"])
    if rec["kind"] == "begin":
        if step == 0:
            return None
        saved = ref.get(step)
        if saved is None:
            return None
        for obj, digest in rec["objects"].items():
            if saved["objects"].get(obj) != digest:
                kind = "data" if obj == "data" else "restored"
                return Finding(name, False, f"after the resume at step {step}, rank {rank}: {obj} differs from what "
                               "the uninterrupted run had there", step=step, rank=rank, what=f"restored.{obj}",
                               hint=USUAL_REASONS[kind].format(obj=obj, step=step))  # fmt: skip
        gen = _rng_differs(rec["rng"], saved["rng_end"], seeded)
        if gen is not None:
            return Finding(name, False, f"step {step + 1}, rank {rank}: the random state ({gen}) differs "
                           f"already before the step (resumed at step {step}; at the loop's start it is not the "
                           "one saved)", step=step + 1, rank=rank, what=f"rng_after_restore.{gen}",
                           hint=USUAL_REASONS["rng_after_restore"])  # fmt: skip
        return None
    if rec["kind"] != "step" or step not in ref:
        return None
    want = ref[step]
    gen = _rng_differs(rec["rng_begin"], want["rng_begin"], seeded)
    if gen is not None:
        return Finding(name, False, f"step {step}, rank {rank}: the random state ({gen}) at the step's start "
                       "differs", step=step, rank=rank, what=f"rng_begin.{gen}",
                       hint=USUAL_REASONS["rng_begin"].format(step=step))  # fmt: skip
    for obj, digest in rec["objects"].items():
        if want["objects"].get(obj) != digest:
            kind = "data" if obj == "data" else "object"
            return Finding(name, False, f"step {step}, rank {rank}: {obj} differs after the step", step=step,
                           rank=rank, what=f"objects.{obj}", hint=USUAL_REASONS[kind].format(obj=obj, step=step))  # fmt: skip
    for key, value in rec["logged"].items():
        if want["logged"].get(key) != value:
            return Finding(name, False, f"step {step}, rank {rank}: logged {key} {value!r}, the uninterrupted "
                           f"run {want['logged'].get(key)!r}", step=step, rank=rank, what=f"logged.{key}",
                           hint=USUAL_REASONS["logged"].format(step=step))  # fmt: skip
    return None


def _missing(run: dict[int, list[Record]], total: int) -> int | None:
    trained = {int(rec["step"]) for rec in run.get(0, []) if rec["kind"] == "step"}
    return next((s for s in range(1, total + 1) if s not in trained), None)


def compare_restore(name: str, run: dict[int, list[Record]], total: int) -> Finding:
    """At another world size: the parameters restored equal those saved, and every step after the
    resume is trained once."""
    records = run.get(0, [])
    ends = [rec for rec in records if rec["kind"] == "end" and rec.get("cause")]
    begins = [rec for rec in records if rec["kind"] == "begin" and rec["step"]]
    if not ends or not begins:
        return Finding(name, False, "the run did not stop and resume as planned (see its log)")
    saved, restored = ends[0], begins[-1]
    if saved["params"] != restored["params"] or saved["step"] != restored["step"]:
        return Finding(name, False, f"the parameters restored on {restored['world_size']} rank(s) at step "
                       f"{restored['step']} differ from those {saved['world_size']} saved at step {saved['step']}",
                       step=restored["step"], what="restored.model",
                       hint=USUAL_REASONS["restored"].format(obj="the model", step=restored["step"]))  # fmt: skip
    after = [
        int(rec["step"])
        for rec in records
        if rec["kind"] == "step" and rec["world_size"] == restored["world_size"]
    ]
    if sorted(after) != list(range(int(restored["step"]) + 1, total + 1)):
        return Finding(name, False, f"after the resume at step {restored['step']} the steps trained were "
                       f"{after[:3]}...{after[-3:]}, not {restored['step'] + 1}..{total} once each")  # fmt: skip
    return Finding(name, True, f"the state saved by {saved['world_size']} ranks at step {saved['step']} restored "
                   f"equal on {restored['world_size']}; steps {restored['step'] + 1}..{total} trained once each "
                   "(losses differ by design: the batch per step is the ranks')")  # fmt: skip
