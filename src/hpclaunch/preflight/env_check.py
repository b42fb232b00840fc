"""The ``env`` check: the job's Python can run the trainer (torch, CUDA/NCCL or gloo, mmdit, hpclaunch)."""

from __future__ import annotations

import re

from .. import __version__
from ..probe_shapes import PackageInfo, TorchInfo
from .check_context import CheckContext, Findings, Outcome, skip
from .container_check import probe_blocker
from .probe import ProbeError

MIN_TORCH = (2, 4)


def _torch_version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _imported(f: Findings, part: TorchInfo | PackageInfo, failed: str, fix: str) -> bool:
    """Whether the probe could import the package ``part`` describes; a failure (``failed``: why)
    where it could not."""
    error = part.get("error")
    if error is None:
        return True
    f.fail(f"{failed}: {error}", fix)
    return False


def check_env(ctx: CheckContext) -> Outcome:
    """Python, torch, CUDA + NCCL (or gloo), mmdit and hpclaunch as the job's interpreter sees them."""
    f = Findings()
    cfg = ctx.cfg
    python = cfg.launch.python or "this interpreter"
    if cfg.container.enabled:  # the ranks' Python is the image's (the agent's stays launch.python)
        python = f"{cfg.container.python} in the image"
        blocked = probe_blocker(cfg, ctx.which)
        if blocked is not None:
            return skip(f"the image's Python is not probed: {blocked}")
    try:
        info = ctx.probe.result()
    except ProbeError as e:
        if ctx.probe.python is None and not ctx.on_node:
            # e.g. a path that only exists after the job's setup lines (module load, conda activate)
            f.warn(
                f"launch.python {python} is not found on this machine; it is checked on each node",
                "make sure scheduler.setup puts it on PATH in the job",
            )
            return f.outcome()
        key = "container.python" if cfg.container.enabled else "launch.python"
        f.fail(f"cannot probe {python}: {e}", f"check {key} and that it can import torch")
        return f.outcome()

    torch = info.get("torch", {})
    if not _imported(
        f, torch, f"torch is not importable by {python}", "install torch>=2.4 into the job's env"
    ):
        return f.outcome()
    version = str(torch.get("version"))
    if _torch_version(version) < MIN_TORCH:
        f.fail(
            f"torch {version} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}", "upgrade torch in the job's env"
        )
    desc = [f"python {info.get('python')}", f"torch {version}"]

    if cfg.backend == "nccl":
        _nccl(ctx, f, torch, desc)
    elif not torch.get("gloo_available"):
        f.fail("this torch build has no gloo backend (CPU ranks need it)", "install a standard torch build")
    else:
        desc.append("gloo")

    mmdit = info.get("mmdit", {})
    if _imported(f, mmdit, "mmdit is not importable", "pip install 'mmdit>=0.3,<0.4' in the job's env"):
        desc.append(f"mmdit {mmdit.get('version')}")

    ours = info.get("hpclaunch", {})
    fix = "install hpclaunch into the job's env (the trainer runs as python -m hpclaunch.trainer)"
    if _imported(f, ours, f"hpclaunch is not importable by {python}", fix):
        if ours.get("version") == __version__:
            desc.append(f"hpclaunch {__version__}")
        else:
            f.warn(
                f"the job's hpclaunch is {ours.get('version')} but this one is {__version__}",
                "install the same hpclaunch version in both environments",
            )

    model = info.get("model", {})
    if "error" in model:
        f.warn(
            f"the model could not be built on the meta device ({model['error']}); sizes are estimated",
            "check the model section; the trainer will fail the same way",
        )
    f.ok(", ".join(desc))
    return f.outcome()


def _nccl(ctx: CheckContext, f: Findings, torch: TorchInfo, desc: list[str]) -> None:
    if not torch.get("cuda_build"):
        f.fail(
            f"torch {torch.get('version')} is a CPU-only build but the run uses NCCL on "
            f"{ctx.cfg.scheduler.gpus_per_node} GPU(s) per node",
            "install a CUDA build of torch in the job's env",
        )
        return
    if not torch.get("nccl_available"):
        f.fail(
            "this torch build has no NCCL backend",
            "install a torch build with NCCL (the pip CUDA wheels have it)",
        )
        return
    desc.append(f"CUDA {torch['cuda_build']}")
    if torch.get("nccl_version"):
        desc.append(f"NCCL {torch['nccl_version']}")
    elif torch.get("nccl_error"):
        f.fail(f"NCCL cannot be loaded: {torch['nccl_error']}", "check the CUDA driver and the NCCL library")
    if not torch.get("cuda_available"):
        if ctx.sees_compute_hardware:
            f.fail("CUDA is not available (no GPU visible or the driver cannot be used)", "check nvidia-smi")
        else:
            desc.append("no GPU on this login node (checked on each node)")
