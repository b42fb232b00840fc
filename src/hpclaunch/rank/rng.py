"""A rank's random number generators, in a form checkpoints can hold and a resume puts back:
Python's ``random``, numpy's legacy global generator, torch's CPU generator and every CUDA
device's.

Everything is a tensor or a plain value, so a checkpoint loads it with ``weights_only=True`` (no
unpickling): numpy's state is its MT19937 key as an int64 tensor plus its position and cached
Gaussian, which is all ``np.random.set_state`` needs. A state saved without a device (a CPU run)
leaves the CUDA generators as they are; one saved with more devices than this rank sees restores
the ones it has.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

__all__ = ["restore_rng_state", "rng_digest", "rng_state"]


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This rank's RNG states (``device`` is accepted for callers that name theirs; every CUDA
    device this process has initialised is saved either way)."""
    _kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": torch.from_numpy(np.asarray(key, dtype=np.int64)),
        "numpy_rng_pos": [int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_rng_all"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng_state(saved: dict[str, Any], device: torch.device | None = None) -> None:
    """Put ``rng_state``'s states back (a round trip through a checkpoint may turn tuples into
    lists; older checkpoints without numpy's position or with one device's ``cuda_rng`` load too)."""
    torch.set_rng_state(saved["torch_rng"])
    version, internal, gauss = saved["python_rng"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    if "numpy_rng_pos" in saved:
        pos, has_gauss, cached = saved["numpy_rng_pos"]
        key = saved["numpy_rng"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", key, int(pos), int(has_gauss), float(cached)))
    if torch.cuda.is_available():
        states = saved.get("cuda_rng_all")
        if states is not None:
            for index, state in enumerate(states[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, index)
        elif "cuda_rng" in saved and device is not None and device.type == "cuda":
            torch.cuda.set_rng_state(saved["cuda_rng"], device)


def rng_digest() -> dict[str, str]:
    """A short digest of each of this process's generators now (verify-resume compares them step by
    step, each on its own: a generator the script never seeds differs between any two runs)."""

    def short(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    _kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {
        "torch": short(torch.get_rng_state().numpy().tobytes()),
        "python": short(repr(random.getstate()).encode()),
        "numpy": short(np.asarray(key).tobytes() + f"{pos},{has_gauss},{cached}".encode()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = short(b"".join(s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()))
    return out
