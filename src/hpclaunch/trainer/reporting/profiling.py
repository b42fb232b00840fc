"""``train.profile``: a few training steps under ``torch.profiler``, summarised where a user reads it.

From the start of step ``start`` to the end of step ``start + steps - 1`` every rank records its host
(CPU) activity, and on CUDA its kernels. Each rank writes ``RUN/profile/rank<r>.json`` and rank 0 also
``rank0.txt`` (the two tables below) and, with ``trace: true``, a Chrome trace
(``rank0.trace.json.gz``, open it in Perfetto). The JSON summary, per profiled step:

- ``step_ms``: wall time of a step (the loop's own measure: data, compute, the grad norm's sync);
- ``gpu_busy_ms`` / ``gpu_busy_fraction``: the union of kernel intervals on the device (what is left
  is the GPU waiting on the host: launches, syncs, Python);
- ``kernels``, ``launches``: kernels run and kernel-launch calls made by the host;
- ``host_syncs``: calls that make the host wait for the device (stream/device/event synchronize,
  synchronous copies to the host);
- ``top_kernels`` and ``top_host_ops``: where the time goes, by device time and by self CPU time.

Nothing of it is collective and nothing is kept between attempts; a step that stops the run ends the
profile early (it is written with the steps it has).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...config import ProfileKnob

# Host calls that launch a kernel, and those that make the host wait for the device.
_LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
_SYNC = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy (.item(), .cpu() of a device tensor)
)


class StepProfiler:
    """Start before step ``knob.start``, stop after ``knob.steps`` steps; ``None`` knob: a no-op."""

    def __init__(self, knob: ProfileKnob | None, out_dir: Path, rank: int, device_type: str):
        self.knob, self.out_dir, self.rank, self.device_type = knob, out_dir, rank, device_type
        self._prof: Any = None
        self._step_ms: list[float] = []
        self.done = knob is None

    def before_step(self, step: int) -> None:
        if self.done or self._prof is not None or self.knob is None or step != self.knob.start:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()  # the profile starts with an idle device, not the last step's tail
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()

    def after_step(self, step: int, step_s: float) -> None:
        if self._prof is None or self.knob is None:
            return
        self._step_ms.append(step_s * 1000)
        if len(self._step_ms) >= self.knob.steps:
            self.finish()

    def finish(self) -> None:
        """End the profile (early, when the run stops inside it) and write the summary."""
        if self._prof is None:
            return
        prof, self._prof, self.done = self._prof, None, True
        if self.device_type == "cuda":
            import torch

            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        summary = summarise(prof, self._step_ms)
        summary["rank"] = self.rank
        (self.out_dir / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.rank == 0:
            (self.out_dir / "rank0.txt").write_text(tables(prof))
            if self.knob is not None and self.knob.trace:
                plain = self.out_dir / "rank0.trace.json"
                prof.export_chrome_trace(str(plain))
                with plain.open("rb") as src, gzip.open(f"{plain}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                plain.unlink()


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    """The length covered by the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(prof: Any, step_ms: list[float]) -> dict[str, Any]:
    """The per-step figures of a finished profile (see the module docstring)."""
    from torch.autograd import DeviceType

    events = prof.events()
    n = max(1, len(step_ms))
    # (a record_function range shows on the device as a span too: Optimizer.step; not a kernel)
    kernels = [
        e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    busy_us = _merged_length([(e.time_range.start, e.time_range.end) for e in kernels])
    launches = sum(1 for e in host if e.name in _LAUNCH)
    syncs = sum(1 for e in host if e.name in _SYNC)
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.time_range.elapsed_us())
    kernel_us = sum(sum(v) for v in by_kernel.values())
    top_kernels = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:15]
    averages = prof.key_averages()
    top_host = sorted((a for a in averages if a.key not in _LAUNCH), key=lambda a: -a.self_cpu_time_total)[
        :15
    ]
    wall = sum(step_ms) / n
    return {
        "steps": len(step_ms),
        "step_ms": wall,
        "gpu_busy_ms": busy_us / 1000 / n,
        "gpu_busy_fraction": (busy_us / 1000 / n) / wall if wall and kernels else None,
        "kernel_ms": kernel_us / 1000 / n,
        "kernels": len(kernels) / n,
        "launches": launches / n,
        "host_syncs": syncs / n,
        "aten_ops": sum(1 for e in host if e.name.startswith("aten::")) / n,
        "top_kernels": [
            {"name": k[:160], "calls": len(v) / n, "ms": sum(v) / 1000 / n} for k, v in top_kernels
        ],
        "top_host_ops": [
            {"name": a.key[:160], "calls": a.count / n, "self_ms": a.self_cpu_time_total / 1000 / n}
            for a in top_host
        ],
    }


def tables(prof: Any) -> str:
    """torch's own tables: by device time (where there is one) and by self CPU time."""
    averages = prof.key_averages()
    parts = []
    with contextlib.suppress(AttributeError, KeyError, ValueError):  # no device activity recorded
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=80))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=80))
    return "\n\n".join(parts) + "\n"
