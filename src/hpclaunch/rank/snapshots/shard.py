"""A shard's description, and the live state filled back from a shard.

The description is the staging layout (every tensor's slot in the payload: offset, dtype, shape), the
plain values serialized as the staging copy serializes them (``torch.save``, read back only with
``weights_only=True``), DCP's flattening paths, and what must match for a restore: the step, the world
size, the rank, the config's and the model's hashes, and the payload's checksum. ``check`` reads all
of it before anything is copied: the description's form, the checksum, every slot against the live
state (same keys, dtypes and shapes, inside the payload) and every plain value decoded; a shard that
is damaged, torn or does not fit changes nothing, and the disk tier serves instead.
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import warnings
import zlib
from collections.abc import Mapping
from typing import Any, NamedTuple, TypedDict

import torch

from ...errors import CheckpointError
from ..checkpoint.safe_load import load_item_safely
from ..checkpoint.staging import Staged, dtype_of
from ..tensors import is_dtensor

FORMAT = 2  # 2: the payload's checksum (crc32)
# What reading a damaged or foreign description can raise (a bug raises anything else).
_UNREADABLE = (ValueError, KeyError, TypeError, IndexError, OverflowError, RuntimeError, EOFError)
State = dict[str, Any]  # a training state dict: nested, whatever the model and optimizer hold


class ShardMeta(TypedDict):
    """A shard's description (its ``.json``)."""

    format: int
    step: int
    rank: int
    world_size: int
    nbytes: int
    slots: list[dict[str, Any]]  # staging.Slot as JSON
    mappings: dict[str, list[str | int]]  # DCP's flattening: fqn -> the path in the nested state
    objects: dict[str, str]  # fqn -> base64 of torch.save(value)
    config_hash: str
    model_hash: str
    crc32: int  # zlib.crc32 of the payload


def describe_bytes(
    staged: Staged, *, step: int, rank: int, world_size: int, hashes: dict[str, str], crc32: int
) -> bytes:
    """``describe`` as the JSON a shard's ``.json`` holds. The layout's part (every slot, the
    flattening paths) is encoded once per layout: encoding it at every snapshot cost 1.5 ms of the
    job's CPU under the GIL (the tiny model's 242 slots)."""
    layout = staged.layout
    cached = _ENCODED.get(layout.id)
    if cached is None:
        d = layout.describe()
        cached = _json({"slots": d["slots"], "mappings": d["mappings"]})[1:-1]
        _ENCODED.clear()  # (one layout at a time per process: the stager replaces it)
        _ENCODED[layout.id] = cached
    rest = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "nbytes": layout.nbytes,
        "objects": staged.objects,
        "config_hash": hashes["config_hash"],
        "model_hash": hashes["model_hash"],
        "crc32": crc32,
    }
    return b"{" + _json(rest)[1:-1] + b"," + cached + b"}"


_ENCODED: dict[str, bytes] = {}  # layout id -> its slots and mappings, encoded


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def describe(
    staged: Staged, *, step: int, rank: int, world_size: int, hashes: dict[str, str], crc32: int
) -> dict[str, Any]:
    layout = staged.layout.describe()
    return {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "nbytes": layout["nbytes"],
        "slots": layout["slots"],
        "mappings": layout["mappings"],
        "objects": staged.objects,
        "config_hash": hashes["config_hash"],
        "model_hash": hashes["model_hash"],
        "crc32": crc32,
    }


def _live_tensors(state: State) -> tuple[dict[str, torch.Tensor], Mapping[str, Any]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    tensors = {}
    for fqn, obj in flat.items():
        if is_dtensor(obj):
            if obj.device_mesh.get_coordinate() is not None:
                tensors[fqn] = obj.to_local()
        elif isinstance(obj, torch.Tensor):
            tensors[fqn] = obj
    return tensors, mappings


def misfit(state: State, meta: ShardMeta, expect: Mapping[str, object]) -> str | None:
    """Why the shard ``meta`` cannot fill ``state`` (None: it can). ``expect``: values that must match."""
    if meta.get("format") != FORMAT:
        return f"snapshot format {meta.get('format')} is not {FORMAT}"
    for key, value in expect.items():
        if meta.get(key) != value:
            return f"the snapshot's {key} is {meta.get(key)!r}, this run's {value!r}"
    tensors, mappings = _live_tensors(state)
    slots = {s["fqn"]: s for s in meta["slots"]}
    if set(slots) != set(tensors):
        extra = sorted(set(slots) ^ set(tensors))
        return f"the snapshot's tensors differ from the state's ({', '.join(extra[:3])})"
    unknown = sorted(set(meta["objects"]) - set(mappings))
    if unknown:
        return f"the snapshot holds values the state has not ({', '.join(unknown[:3])})"
    for fqn, t in tensors.items():
        s = slots[fqn]
        if dtype_of(s["dtype"]) != t.dtype or list(t.shape) != list(s["shape"]):
            return f"{fqn} is {s['dtype']}{s['shape']} in the snapshot, {t.dtype}{list(t.shape)} in the state"
        size = math.prod(t.shape) * t.element_size()
        if int(s["nbytes"]) != size or not 0 <= int(s["offset"]) <= int(meta["nbytes"]) - size:
            return f"{fqn}'s place in the snapshot lies outside it"
    return None


class Checked(NamedTuple):
    """A shard that ``check`` found whole and fitting: what ``fill`` copies."""

    meta: ShardMeta
    payload: Any  # bytes-like: a read-only mapping of the tmpfs file, or a received tensor
    objects: dict[str, Any]  # fqn -> the plain value, decoded


def check(state: State, meta_bytes: bytes, payload: Any, expect: Mapping[str, object]) -> Checked | str:
    """The shard whole and fitting ``state``, with its plain values decoded; else why not (in the
    user's words). Nothing is copied here."""
    try:
        meta = parse(meta_bytes)
        why = misfit(state, meta, expect)
        if why is not None:
            return why
        data = payload.numpy().data if isinstance(payload, torch.Tensor) else payload
        if len(data) != meta["nbytes"]:
            return f"the snapshot's payload is {len(data)} bytes, its description says {meta['nbytes']}"
        if zlib.crc32(data) != meta["crc32"]:
            return "the snapshot is damaged (its payload's checksum differs from its description's)"
        objects = {
            fqn: load_item_safely(io.BytesIO(base64.b64decode(text)), f"memory snapshot item {fqn}")
            for fqn, text in meta["objects"].items()
        }
    except (*_UNREADABLE, pickle.UnpicklingError, CheckpointError) as e:
        return f"the snapshot cannot be read: {type(e).__name__}: {e}"
    return Checked(meta, payload, objects)


def fill(state: State, shard: Checked) -> set[str]:
    """Copy the shard into ``state`` (after ``check`` passed on every rank); the state's sections it held."""
    from torch.distributed.checkpoint._traverse import set_element

    meta, payload = shard.meta, shard.payload
    tensors, mappings = _live_tensors(state)
    if isinstance(payload, torch.Tensor):
        base = payload
    else:
        with warnings.catch_warnings():  # (read-only bytes: only read from here)
            warnings.simplefilter("ignore", UserWarning)
            base = (
                torch.frombuffer(payload, dtype=torch.uint8)
                if len(payload)
                else torch.empty(0, dtype=torch.uint8)
            )
    with torch.no_grad():
        for s in meta["slots"]:
            view = (
                base[s["offset"] : s["offset"] + s["nbytes"]].view(dtype_of(s["dtype"])).reshape(s["shape"])
            )
            tensors[s["fqn"]].copy_(view)
    for fqn, value in shard.objects.items():
        set_element(state, tuple(mappings[fqn]), value)
    return {str(path[0]) for path in mappings.values()}


def parse(meta_bytes: bytes) -> ShardMeta:
    meta = json.loads(meta_bytes)
    if not isinstance(meta, dict) or not {"slots", "objects", "mappings", "nbytes", "crc32"} <= meta.keys():
        raise ValueError("a snapshot's description is not one")
    return meta  # type: ignore[return-value]  # (checked whole by misfit before any use)
