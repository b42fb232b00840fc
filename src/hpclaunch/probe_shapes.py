"""The probe's JSON, declared once: what preflight sends the job's Python and what it prints back.

Two sides of a process boundary use these shapes: the trainer's scripts write them
(``trainer/probe_main.py``, ``trainer/step_probe.py``, run by path in the job's interpreter) and
preflight reads them (``preflight/probe.py``, torch-free, which never imports the trainer). A
top-level module of its own because neither side may import the other; it imports nothing but
``typing`` at run time, so the scripts can name it where hpclaunch is importable (they import it
only for the type checker: they must run where it is not).

Every part of an answer may be ``{"error": why}`` instead (the script's ``_guard``): hence
``total=False`` and an ``error`` key in each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from .fsutil import JSONObject


class TorchDevice(TypedDict):
    index: int
    name: str
    total_memory: int
    capability: list[int]


class TorchInfo(TypedDict, total=False):
    version: str
    cuda_build: str | None
    cuda_available: bool
    device_count: int
    devices: list[TorchDevice]
    distributed: bool
    gloo_available: bool
    nccl_available: bool
    nccl_version: str | None
    nccl_error: str
    error: str


class PackageInfo(TypedDict, total=False):
    """mmdit's or hpclaunch's: its version (hpclaunch's path too)."""

    version: str
    path: str  # hpclaunch's only
    error: str


class ModelInfo(TypedDict, total=False):
    params: int
    source: str
    error: str


class ProbeAnswer(TypedDict, total=False):
    python: str
    executable: str
    torch: TorchInfo
    mmdit: PackageInfo
    hpclaunch: PackageInfo
    model: ModelInfo  # only when the request named a model
    seconds: float


class StepRequest(TypedDict):
    """What the step probe reads: the run's config and how many steps to time after a warm-up."""

    config: JSONObject  # RunConfig.to_dict()
    steps: int


class StepMeasure(TypedDict, total=False):
    """The measured steps (``trainer/step_probe.py``), or ``{"error": why}`` (a device with it)."""

    seconds_per_step: float
    device: str
    imports_s: float
    build_s: float
    steps: int
    error: str


class ScriptRequest(TypedDict):
    """A script's run: the script to run as far as its ``hpclaunch.attach`` (``rank/script_probe.py``)."""

    path: str
    args: list[str]
    workdir: str | None


class ScriptMeasure(TypedDict, total=False):
    """What the script's probe saw when the script reached ``attach``, or ``{"error": why}``."""

    attach_s: float  # from the script's start to its attach (imports, building)
    state_bytes: int  # one rank's share of the state a checkpoint holds (one rank here: all of it)
    params: int
    objects: list[str]
    device: str
    error: str


class ProbeRequest(TypedDict, total=False):
    """What the probe reads on stdin: the model to count (ModelConfig's JSON dump), and the steps to
    time after it (``estimate``) when preflight estimates the run; or a script to run as far as its
    attach (``script``)."""

    model: JSONObject | None
    estimate: StepRequest
    script: ScriptRequest
