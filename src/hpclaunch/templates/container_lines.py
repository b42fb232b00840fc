"""What a job script says about the run's container: the command each node's agent starts its rank
host with, computed by the same function the agent calls (``JobPlan.rank_host_argv``), every
argument quoted by the one quoting function. Comments: the agent runs it, not the script (the
agent must stay outside the image: it needs the scheduler's commands and the node)."""

from __future__ import annotations

from ..rundir.container import IN_IMAGE_TMP, NODE, NODE_DIR, PASSED_NAMES, PASSED_PREFIXES
from ..rundir.plan import JobPlan
from .shell import Raw, join


def container_lines(plan: JobPlan) -> list[Raw]:
    """Comment lines for the script (none without a container)."""
    c = plan.container
    if c is None:
        return []
    where = f" ({NODE}: the node's name)" if c.runtime == "pyxis" else ""
    lines = [
        f"# container ({c.runtime}): each node's agent runs here and starts its rank host, and so the "
        f"ranks, in the image{where}:",
        "#   " + join(plan.rank_host_argv()),
        f"# {NODE_DIR}: this user's node-local directory (hpclaunch-<uid> in the node's $TMPDIR or /tmp), "
        f"at {IN_IMAGE_TMP}/<its name> in the image",
    ]
    if c.runtime in ("apptainer", "singularity"):
        names = " ".join([*(p + "*" for p in PASSED_PREFIXES), *c.env])
        lines.append(
            f"# passed as {c.runtime.upper()}ENV_<name>, the node's value winning over the image's: {names}"
        )
    elif c.runtime == "pyxis":
        names = ", ".join([*(p + "*" for p in PASSED_PREFIXES), *PASSED_NAMES])
        lines.append(
            f"# --container-env also names each variable set on the node of these, its value winning over the image's: {names}"
        )
    elif c.runtime == "charliecloud":
        lines.append("# ch-run passes the node's environment whole (the image's own is not applied)")
    return [Raw(line) for line in lines]
