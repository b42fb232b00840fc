"""Run the checks concurrently, each bounded by its own timeout, and collect a Report.

Every check gets a daemon thread (a check stuck in a dead NFS mount or a hung ``sinfo`` cannot hold
up the others or the exit); the probe subprocess is started before any thread so that its torch
import overlaps everything else. A check that raises becomes a fail naming the exception; one that
outlives its timeout becomes a fail saying so.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..errors import HpclaunchError, UserInputError, debug_enabled, did_you_mean
from ..schedulers.protocol import NodeContext
from .check_context import CheckContext, Outcome, RunCommand, run_command
from .container_check import check_container, job_probe
from .data_check import check_data
from .disk import check_disk
from .env_check import check_env
from .fds import check_fds
from .gpu import check_gpu
from .layout import check_config
from .network import check_network
from .node import check_node
from .probe import Probe, StaticProbe
from .results import CheckResult, Report, Status
from .scheduler_check import check_scheduler
from .script_check import SCRIPT_PROBE_S, check_script

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Check:
    name: str
    func: Callable[[CheckContext], Outcome]
    timeout_s: float
    needs_probe: bool = False

    @property
    def doc(self) -> str:
        return (self.func.__doc__ or "").strip().splitlines()[0]


CHECKS: dict[str, Check] = {
    c.name: c
    for c in (
        Check("env", check_env, PROBE_TIMEOUT_S + 5, needs_probe=True),
        Check("gpu", check_gpu, PROBE_TIMEOUT_S + 30, needs_probe=True),
        Check("data", check_data, 60),
        Check("disk", check_disk, PROBE_TIMEOUT_S + 10, needs_probe=True),
        Check("network", check_network, 20),
        Check("scheduler", check_scheduler, 45),
        Check("config", check_config, PROBE_TIMEOUT_S + 5, needs_probe=True),
        Check("node", check_node, 10),
        Check("fds", check_fds, 5),
        Check("container", check_container, PROBE_TIMEOUT_S + 5, needs_probe=True),
        Check("script", check_script, SCRIPT_PROBE_S + 10, needs_probe=True),
    )
}
LOGIN_CHECKS = ("env", "gpu", "data", "disk", "network", "scheduler", "config", "fds", "container", "script")
NODE_CHECKS = ("node", "env", "gpu", "data", "disk", "network", "fds", "container")


def select(names: Iterable[str], only: Iterable[str] | None, *, where: str) -> list[Check]:
    """The checks to run, in order; an unknown name in ``only`` is bad input (exit 2)."""
    names = list(names)
    if only is None:
        return [CHECKS[n] for n in names]
    wanted = {n.strip() for n in only if n.strip()}
    unknown = sorted(wanted - set(names))
    if unknown or not wanted:
        raise UserInputError(
            f"unknown {where} check {unknown[0]!r}{did_you_mean(unknown[0], names)}"
            if unknown
            else "no check named",
            where="--only",
            hint=f"{where} checks: {', '.join(names)}",
        )
    return [CHECKS[n] for n in names if n in wanted]


def run_checks(checks: list[Check], ctx: CheckContext, *, where: str, close_probe: bool = True) -> Report:
    """Run ``checks`` concurrently on ``ctx``; the report keeps their order.

    The probe is killed at the end unless ``close_probe`` is False: its caller started it, and
    closes it (preflight's probe goes on timing the estimate's steps).
    """
    start = time.monotonic()
    slots: list[dict[str, CheckResult]] = [{} for _ in checks]
    threads = []
    for check, slot in zip(checks, slots, strict=True):
        t = threading.Thread(
            target=_run_one, args=(check, ctx, slot), name=f"preflight-{check.name}", daemon=True
        )
        t.start()
        threads.append((t, time.monotonic()))
    results = []
    try:
        for check, slot, (thread, started) in zip(checks, slots, threads, strict=True):
            thread.join(max(0.0, started + check.timeout_s - time.monotonic()))
            result = slot.get("result")
            if result is None:
                result = CheckResult(
                    check.name,
                    Status.FAIL,
                    f"did not finish within {check.timeout_s:g} s",
                    "something it waits on hangs (a filesystem, the scheduler, the job's Python)",
                    time.monotonic() - started,
                )
            results.append(result)
    finally:
        if close_probe:
            ctx.probe.close()
    return Report(results, time.monotonic() - start, where=where)


def _run_one(check: Check, ctx: CheckContext, slot: dict[str, CheckResult]) -> None:
    start = time.monotonic()
    try:
        out = check.func(ctx)
    except HpclaunchError as e:
        out = Outcome(Status.FAIL, e.one_line(), e.hint)
    except Exception as e:
        if debug_enabled():
            traceback.print_exc(file=sys.stderr)
        out = Outcome(
            Status.FAIL,
            f"the check itself failed: {type(e).__name__}: {e}",
            "a bug in hpclaunch; rerun with HPCLAUNCH_DEBUG=1 and report the traceback",
        )
    slot["result"] = CheckResult(check.name, out.status, out.finding, out.hint, time.monotonic() - start)


@dataclass(frozen=True)
class HostView:
    """The host as the checks read it: its sysfs, environment, commands and PATH lookup.

    The defaults are the real host; tests pass stand-ins for any of them.
    """

    sysfs_root: Path = Path("/sys")
    environ: Mapping[str, str] | None = None
    run: RunCommand | None = None
    which: Callable[[str], str | None] | None = None


def _context(
    cfg: RunConfig,
    node: NodeContext | None,
    checks: list[Check],
    host: HostView,
    probe: Probe | StaticProbe | None,
) -> CheckContext:
    if probe is None:
        if any(c.needs_probe for c in checks):
            probe = job_probe(cfg, timeout_s=PROBE_TIMEOUT_S, which=host.which or shutil.which)
        else:
            probe = StaticProbe(error="not needed by the selected checks")
    ctx = CheckContext(
        cfg=cfg, node=node, probe=probe, sysfs_root=host.sysfs_root, run=host.run or run_command
    )
    if host.environ is not None:
        ctx.environ = host.environ
    if host.which is not None:
        ctx.which = host.which
    return ctx


def run_login_checks(
    cfg: RunConfig,
    *,
    only: set[str] | None = None,
    host: HostView = HostView(),
    probe: Probe | StaticProbe | None = None,
) -> Report:
    """The login-node / workstation preflight (``hpclaunch preflight``; ``submit`` refuses on a fail).

    ``host`` and ``probe`` replace the outside world in tests. A probe passed in is its caller's to
    close; one started here is closed here.
    """
    checks = select(LOGIN_CHECKS, only, where="login")
    ctx = _context(cfg, None, checks, host, probe)
    return run_checks(checks, ctx, where="login", close_probe=probe is None)


def run_node_checks(
    cfg: RunConfig,
    ctx: NodeContext,
    *,
    only: set[str] | None = None,
    host: HostView = HostView(),
    probe: Probe | StaticProbe | None = None,
) -> Report:
    """The checks the node agent runs on every allocated node before the ranks start."""
    checks = select(NODE_CHECKS, only, where="node")
    cctx = _context(cfg, ctx, checks, host, probe)
    return run_checks(checks, cctx, where=f"node {ctx.hostname}")
