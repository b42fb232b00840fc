"""The ``container`` check: the runtime is there, the image exists and can be read, and the image's
Python starts hpclaunch's trainer (the probe, run through the runtime: ``job_probe``).

On a node (the agent's checks before every attempt) only the cheap parts run: a node that lost the
runtime or the filesystem holding the image is replaced or kept off like any node failing a check.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .. import __version__
from ..config import RunConfig
from ..fsutil import JSONObject
from ..probe_shapes import ScriptRequest, StepRequest
from ..rundir.container import ContainerPlan
from ..rundir.node_dir import consume_seen, node_directory
from .check_context import CheckContext, Findings, Outcome, skip
from .probe import InImage, Probe, ProbeError, StaticProbe, job_python

# How to get each runtime, and how an image is made for it.
INSTALL = {
    "pyxis": "pyxis is a SLURM plugin the site installs (srun --container-image); ask the admins",
    "apptainer": "load the module that provides it (scheduler.setup) or install Apptainer",
    "singularity": "load the module that provides it (scheduler.setup) or install SingularityCE",
    "podman": "install podman (Debian: apt-get install podman) or set container.command (e.g. podman-hpc)",
    "charliecloud": "install Charliecloud (Debian: apt-get install charliecloud-runtime)",
}
BUILD = {
    "pyxis": "enroot import -o IMAGE.sqsh docker://REGISTRY#IMAGE:TAG",
    "apptainer": "apptainer build IMAGE.sif docker://IMAGE:TAG",
    "singularity": "singularity build IMAGE.sif docker://IMAGE:TAG",
    "podman": "a root filesystem directory (podman export | tar -x), or name a podman image instead",
    # Debian's charliecloud-runtime ships ch-run alone (no ch-image, ch-convert): an image is any
    # root filesystem tree, unpacked from another tool's export or a tarball.
    "charliecloud": "a root filesystem directory: mkdir DIRECTORY && podman export $(podman create "
    "IMAGE:TAG) | tar -x -C DIRECTORY (or docker export, or a rootfs tarball); docs/clusters.md, 'Making an image'",
}


def probe_blocker(cfg: RunConfig, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """Why the probe cannot run in the run's image from here (None: it can, or there is no image)."""
    plan = ContainerPlan.from_config(cfg)
    if plan is None:
        return None
    if not plan.runs_outside_an_allocation:
        return f"{plan.runtime} starts the image only inside a job's srun step"
    if which(plan.command) is None:
        return f"{plan.command} is not on PATH here"
    if plan.image_is_path and not os.access(plan.image, os.R_OK):
        return f"the image {plan.image} cannot be read here"
    return None


def job_probe(
    cfg: RunConfig,
    *,
    timeout_s: float,
    estimate: StepRequest | None = None,
    env: dict[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> Probe | StaticProbe:
    """The probe of the job's Python: in the run's image (through its runtime) when it has one. A
    script's run counts no MMDiT: its probe runs the script as far as its attach instead."""
    model: JSONObject | None = None if cfg.is_script else cfg.model.model_dump(mode="json")
    script: ScriptRequest | None = None
    if cfg.is_script:
        s = cfg.script
        script = {"path": str(s.path), "args": list(s.args), "workdir": s.workdir}
        estimate = None
    plan = ContainerPlan.from_config(cfg)
    if plan is None:
        return Probe(
            job_python(cfg.launch.python), model=model, timeout_s=timeout_s, estimate=estimate, env=env,
            script=script,
        )  # fmt: skip
    blocked = probe_blocker(cfg, which)
    if blocked is not None:
        return StaticProbe(error=f"not run: {blocked} (the container check says more)", python=plan.python)
    probe_plan = plan.for_probe()
    return Probe(
        plan.python,
        model=model,
        timeout_s=timeout_s,
        estimate=estimate,
        env=env,
        script=script,
        # (the node directory proved as the agents will use it: ``_node_dir``)
        image=InImage(probe_plan, node_directory(in_image=True)),
    )


def check_container(ctx: CheckContext) -> Outcome:
    """The container runtime is there, the image can be read, and hpclaunch's trainer starts in it."""
    cfg = ctx.cfg
    plan = ContainerPlan.from_config(cfg)
    if plan is None:
        return skip("no container (container.runtime: none)")
    f = Findings()
    where = f"on node {ctx.node.hostname}" if ctx.node is not None else "here"
    found = _runtime(ctx, plan, f, where)
    image_ok = _image(plan, f, where)
    if ctx.on_node or not (found and image_ok):
        return f.outcome()
    if not plan.runs_outside_an_allocation:
        f.skip("the image's Python is started by srun inside the job only (not from a login node)")
        return f.outcome()
    _trainer_starts(ctx, plan, f)
    return f.outcome()


def _runtime(ctx: CheckContext, plan: ContainerPlan, f: Findings, where: str) -> bool:
    if ctx.which(plan.command) is None:
        f.fail(
            f"container.runtime {plan.runtime}: {plan.command} is not on PATH {where}",
            INSTALL[plan.runtime] if plan.command == _default(plan) else "check container.command",
        )
        return False
    if plan.runtime == "pyxis":
        out = ctx.run([plan.command, "--help"], 20)
        if out is not None and "--container-image" not in out.stdout + out.stderr:
            f.fail(f"srun {where} has no --container-image: the pyxis plugin is not loaded", INSTALL["pyxis"])
            return False
    f.ok(f"{plan.command} ({plan.runtime})")
    return True


def _default(plan: ContainerPlan) -> str:
    from ..rundir.container import EXECUTABLES

    return EXECUTABLES[plan.runtime]


def _image(plan: ContainerPlan, f: Findings, where: str) -> bool:
    if not plan.image_is_path:
        f.skip(f"image {plan.image} is a registry reference: pulled when the job starts")
        return True
    path = Path(plan.image)
    build = f"make it ({BUILD[plan.runtime]}) or fix container.image"
    if not path.exists():
        f.fail(f"container.image {path} does not exist {where}", build)
        return False
    readable = os.access(path, os.R_OK) and (not path.is_dir() or os.access(path, os.X_OK))
    if not readable:
        f.fail(f"container.image {path} is not readable by this user {where}", "chmod a+rX it, or copy it")
        return False
    if plan.runtime in ("charliecloud", "podman") and not path.is_dir():
        f.fail(f"container.image {path} is not a directory: {plan.runtime} runs an image directory", build)
        return False
    if plan.runtime == "charliecloud" and not _mount_points(plan, path, f):
        return False
    f.ok(f"image {path}")
    return True


def _mount_points(plan: ContainerPlan, image: Path, f: Findings) -> bool:
    """ch-run mounts onto directories the image already has (it cannot create them in a read-only
    image); the host's /tmp, /dev, /proc and /sys are its own."""
    shared = ("/tmp", "/dev", "/proc", "/sys")
    for m in plan.mounts:
        inside = Path(m.dst)
        if any(inside.is_relative_to(s) for s in shared) or (image / inside.relative_to("/")).is_dir():
            continue
        f.fail(
            f"container.image {image} has no directory {inside} to mount {m.src} on",
            f"create it in the image (mkdir -p {image}{inside}) or mount a directory the image has",
        )
        return False
    return True


def _trainer_starts(ctx: CheckContext, plan: ContainerPlan, f: Findings) -> None:
    try:
        info = ctx.probe.result()
    except ProbeError as e:
        f.fail(
            f"{plan.python} did not start in the image through {plan.command}: {e}",
            "check container.python (the image's Python) and container.flags",
        )
        return
    ours = info.get("hpclaunch", {})
    if "error" in ours:
        f.fail(
            f"hpclaunch's trainer cannot start in the image: {ours['error']}",
            f"install hpclaunch {__version__} (with torch and mmdit) into the image, or point container.python "
            "at the image's Python that has it",
        )
    elif ours.get("version") != __version__:
        f.warn(
            f"the image's hpclaunch is {ours.get('version')}, this one {__version__}: the agent and the ranks "
            "must speak the same protocol",
            f"install hpclaunch {__version__} into the image",
        )
    else:
        f.ok(f"{plan.python} in the image starts hpclaunch {__version__} ({info.get('executable')})")
    _node_dir(ctx, f)


def _node_dir(ctx: CheckContext, f: Findings) -> None:
    """What the ranks and their node agent share on a node (``rundir.node_dir``), proved: the probe
    wrote a token in the node directory as the image sees it, read back here outside."""
    proof = getattr(ctx.probe, "node_dir_proof", None)
    if proof is None:
        return
    node_dir, token = proof
    if consume_seen(node_dir.path, token):
        f.ok(f"the node directory {node_dir.path} is the image's {node_dir.ranks_path}")
    else:
        f.warn(
            f"the image does not see the node directory {node_dir.path} at {node_dir.ranks_path}: the "
            "ranks' heartbeats would go to the run directory (one file per rank per second on the "
            "shared filesystem) and the compile cache would not outlive an attempt",
            "check container.flags: a flag that hides /tmp's mounts, or a runtime that refuses the mount",
        )
