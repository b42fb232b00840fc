"""Runs in the JOB's Python (``launch.python``) as a plain script: what that interpreter can do.

Kept free of relative imports so that it runs even where hpclaunch itself is not importable (which
it then reports). Reads ``{"model": {...}}`` on stdin, prints one JSON object as its last stdout
line: python, torch (version, CUDA build, devices, NCCL/gloo), mmdit, hpclaunch, and the model's
parameter count built on the meta device (no memory, no init cost). Every part reports its own
error instead of failing the whole probe. Preflight (torch-free) runs it by path, never imports it.
With ``"estimate": {"config": {...}, "steps": N}`` in the request it then times N training steps
(``step_probe.measure``) in the same process, torch already imported, and prints
``{"step_estimate": {...}}`` as a second line; with ``"script": {...}`` it runs a user's script as
far as its ``hpclaunch.attach`` (``rank.script_probe``) and prints ``{"script_probe": {...}}``.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:  # not at run time: the probe runs where hpclaunch may not be importable
    from hpclaunch.fsutil import JSONObject
    from hpclaunch.probe_shapes import (  # what it prints, in preflight's words (one declaration)
        ModelInfo,
        PackageInfo,
        ProbeAnswer,
        ProbeRequest,
        ScriptMeasure,
        StepMeasure,
        StepRequest,
        TorchDevice,
        TorchInfo,
    )


Part = TypeVar("Part", "TorchInfo", "PackageInfo", "ModelInfo", "StepMeasure", "ScriptMeasure")


def _torch() -> TorchInfo:
    import torch

    info: TorchInfo = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    info["cuda_available"] = bool(torch.cuda.is_available())
    devices: list[TorchDevice] = []
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": p.name,
                    "total_memory": int(p.total_memory),
                    "capability": [p.major, p.minor],
                }
            )
    info["device_count"] = len(devices)
    info["devices"] = devices
    import torch.distributed as dist

    info["distributed"] = bool(dist.is_available())
    info["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    info["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    info["nccl_version"] = None
    if info["nccl_available"]:
        try:
            v = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception as e:  # NCCL present in the build but not loadable
            info["nccl_error"] = f"{type(e).__name__}: {e}"
    return info


def _version(dist_name: str, module: Any) -> str:
    v = getattr(module, "__version__", None)
    if v:
        return str(v)
    from importlib.metadata import version

    return version(dist_name)


def _mmdit() -> PackageInfo:
    import mmdit

    return {"version": _version("mmdit", mmdit)}


def _hpclaunch() -> PackageInfo:
    import hpclaunch

    return {"version": hpclaunch.__version__, "path": str(getattr(hpclaunch, "__file__", ""))}


def _model(model_cfg: JSONObject) -> ModelInfo:
    import torch

    from hpclaunch.config import ModelConfig
    from hpclaunch.trainer.model import mmdit_diffusion as model_mod

    mc = ModelConfig.model_validate(model_cfg)
    with torch.device("meta"):
        model = model_mod.build_model(mc, seed=0)
    count = getattr(model_mod, "count_parameters", None)
    params = int(count(model)) if count else sum(p.numel() for p in model.parameters())
    return {"params": params, "source": "build_model on the meta device"}


def _guard(fn: Callable[..., Part], *args: Any) -> Part:
    try:
        return fn(*args)
    except BaseException as e:  # report anything (ImportError, CUDA init errors, SystemExit)
        # every part's shape has this key for it (the cast: mypy cannot build a TypeVar's dict)
        return cast(Part, {"error": f"{type(e).__name__}: {e}".strip()[:500]})


def _prove_node_dir() -> None:
    """Write the token preflight gave in the node directory as this image sees it (read back outside:
    ``preflight.container_check``); an older image's hpclaunch without it is said by the version row."""
    try:
        from hpclaunch.rundir.node_dir import write_seen
    except ImportError:
        return
    unseen = write_seen()
    if unseen is not None:
        print(f"probe: the node directory: {unseen}", file=sys.stderr)


def main() -> None:
    start = time.monotonic()
    request: ProbeRequest
    try:
        request = json.loads(sys.stdin.read() or "{}")
    except ValueError:
        request = {}
    out: ProbeAnswer = {"python": platform.python_version(), "executable": sys.executable}
    out["torch"] = _guard(_torch)
    out["mmdit"] = _guard(_mmdit)
    out["hpclaunch"] = _guard(_hpclaunch)
    if request.get("model") is not None and "error" not in out["torch"]:
        out["model"] = _guard(_model, request["model"])
    _prove_node_dir()
    out["seconds"] = round(time.monotonic() - start, 3)
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()  # the checks go on with this answer while the steps below are timed
    if request.get("script") is not None:
        script: ScriptMeasure
        if "error" in out["torch"]:
            script = {"error": f"torch: {out['torch']['error']}"}
        else:
            script = _guard(_script, request["script"])
        sys.stdout.write(json.dumps({"script_probe": script}) + "\n")
        sys.stdout.flush()
    if request.get("estimate") is not None:
        if "error" in out["torch"]:
            step: StepMeasure = {"error": f"torch: {out['torch']['error']}"}
        else:
            step = _guard(_steps, request["estimate"], start)
        sys.stdout.write(json.dumps({"step_estimate": step}) + "\n")
        sys.stdout.flush()


def _script(request: Any) -> ScriptMeasure:
    """A script's run: the script as far as its attach (``rank.script_probe``), torch imported."""
    from hpclaunch.rank.script_probe import probe

    return cast("ScriptMeasure", probe(request))


def _steps(request: StepRequest, start: float) -> StepMeasure:
    """Preflight's estimate: a few timed training steps (``step_probe``), torch already imported."""
    from hpclaunch.trainer.step_probe import measure

    return measure(request, started=start)


if __name__ == "__main__":
    main()
