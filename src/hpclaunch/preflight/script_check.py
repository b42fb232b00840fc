"""The checks of a script's run (``script.path``): its files are where the ranks will look, and it
reaches its ``hpclaunch.attach`` (the probe runs it alone, as far as attach, in the job's Python:
imports, building, what a checkpoint will hold). The built-in trainer's run skips them."""

from __future__ import annotations

import os
from pathlib import Path

from ..fsutil import human_bytes
from .check_context import CheckContext, Findings, Outcome, skip

SCRIPT_PROBE_S = 180.0  # from the probe's start: torch's import, then the script's own, until attach


def check_script_files(ctx: CheckContext) -> Outcome:
    """The script is a readable file and its working directory exists (here, or on this node)."""
    s = ctx.cfg.script
    f = Findings()
    path = Path(str(s.path))
    where = f"on node {ctx.node.hostname}" if ctx.node is not None else "here"
    if not path.is_file():
        f.fail(f"script.path {path} is not a file {where}", "put the script on storage every node reads")
    elif not os.access(path, os.R_OK):
        f.fail(f"script.path {path} is not readable {where}", "fix its permissions")
    if s.workdir and not Path(s.workdir).is_dir():
        f.fail(f"script.workdir {s.workdir} does not exist {where}", "create it, or set script.workdir")
    if not f.items:
        f.ok(f"{path.name} {' '.join(s.args)}".rstrip() + f" in {s.workdir}; it reads its own data")
    return f.outcome()


def check_script(ctx: CheckContext) -> Outcome:
    """The script, run alone in the job's Python, reaches ``hpclaunch.attach``."""
    if not ctx.cfg.is_script:
        return skip("the built-in MMDiT trainer (no script.path)")
    probe = ctx.probe
    if probe is None:
        return skip("no probe")
    measure = probe.script_probe(SCRIPT_PROBE_S)
    f = Findings()
    error = measure.get("error")
    if error is not None:
        f.warn(
            f"the script did not reach hpclaunch.attach() when run alone here: {error}",
            "run it with plain python to see why; a script that needs the nodes' GPUs or its "
            "peers fails here but may run in the job",
        )
        return f.outcome()
    state = int(measure.get("state_bytes") or 0)
    f.ok(
        f"reached attach in {measure.get('attach_s', 0):.1f} s on {measure.get('device')}; "
        f"{', '.join(measure.get('objects') or [])} attached; a checkpoint holds ~{human_bytes(state)} "
        f"per rank ({int(measure.get('params') or 0):,} parameters)"
    )
    return f.outcome()
