"""The staging copy a background save is written from: the state's tensors copied into one buffer of
shared memory that the writer process maps, so the next step may change the live tensors at once.

Layout. The state dict is flattened as DCP flattens it (``flatten_state_dict``: the same keys and
the same object paths in the metadata as a save from the training process). Every tensor gets a slot
(offset, dtype, shape) in one buffer; a DTensor's local shard gets one too, with its place in the
global tensor (global shape, chunk offsets), so the writer needs no device mesh. Every other value
(ints, floats, lists, the Python RNG's tuple) is serialized here with ``torch.save``, as DCP would
serialize it, and goes to the writer as bytes: the writer never unpickles anything. The buffer is
made once and reused while the state keeps its structure; a new structure gets a new buffer.

Memory. The buffer is a memfd (anonymous shared memory; an unlinked temporary file where memfd is
missing): a second copy of this rank's state in host memory, which preflight counts per node.

CUDA. The buffer is pinned (``cudaHostRegister``) and the copies are non-blocking on a side stream
that first waits for the training stream: ``stage`` returns once they are queued, the next step's
forward and backward overlap them, and the optimizer step waits for them on the GPU
(``before_update``), never on the host. The writer is told to start once they are done
(``Staged.ready``). On CPU the same code copies synchronously and is ready at once.
"""

from __future__ import annotations

import base64
import contextlib
import io
import mmap
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..tensors import is_dtensor

ALIGN = 64  # every slot starts on a cache line (and on any dtype's alignment)
_SCALARS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class Slot:
    """Where one tensor of the flattened state lives in the buffer."""

    fqn: str
    offset: int
    nbytes: int
    dtype: str  # "float32", "bfloat16", ...
    shape: list[int]
    global_shape: list[int] | None = None  # a DTensor's local shard: the whole tensor's shape
    chunk_offsets: list[int] | None = None  # and where the shard starts in it


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The dtype a slot names (never ``getattr`` of an arbitrary attribute of torch)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def new_shared_fd(nbytes: int) -> int:
    """A file descriptor of ``nbytes`` of shared memory that another process can map."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("hpclaunch-staging", os.MFD_CLOEXEC)
    else:  # not Linux: an unlinked file in the temporary directory
        with tempfile.TemporaryFile() as handle:
            fd = os.dup(handle.fileno())
    os.ftruncate(fd, max(nbytes, 1))
    return fd


def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class Layout:
    """One shared buffer and the slot of every tensor in it (the training process's side)."""

    def __init__(self, slots: list[Slot], mappings: dict[str, list[Any]], nbytes: int, *, pin: bool):
        self.id = uuid.uuid4().hex[:12]
        self._described: dict[str, Any] | None = None
        self.slots = slots
        self.mappings = mappings
        self.nbytes = nbytes
        self.fd = new_shared_fd(nbytes)
        self._mm = map_fd(self.fd, nbytes)
        base = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._pinned = pin and nbytes > 0 and _pin(base.data_ptr(), nbytes)
        self._base_ptr = base.data_ptr()
        self.views = [
            base[s.offset : s.offset + s.nbytes].view(dtype_of(s.dtype)).reshape(s.shape) for s in slots
        ]
        del base

    @property
    def pinned(self) -> bool:
        return self._pinned

    def view(self) -> memoryview:
        """The buffer's bytes, read in place (the memory tier's checksum)."""
        return memoryview(self._mm)[: self.nbytes]

    def describe(self) -> dict[str, Any]:
        """The layout as the writer process needs it (JSON; the fd travels beside it). Made once: a
        layout never changes, and ``asdict`` of every slot cost 10 ms of a memory-tier snapshot's
        13 ms of CPU (the tiny model's 242 slots), under the GIL the training thread needs."""
        if self._described is None:
            self._described = {
                "id": self.id,
                "nbytes": self.nbytes,
                "slots": [asdict(s) for s in self.slots],
                "mappings": self.mappings,
            }
        return self._described

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._base_ptr)
            self._pinned = False
        self.views = []
        with contextlib.suppress(BufferError, ValueError):  # a view still held elsewhere: GC frees it
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _pin(ptr: int, nbytes: int) -> bool:
    """Page-lock the buffer for the GPU's copies (flag 1: portable); a refusal costs speed, not a save."""
    if not torch.cuda.is_available():
        return False
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)) == 0


@dataclass
class Staged:
    """One save's staged copy: the buffer, the serialized values, and on CUDA the copies' event."""

    layout: Layout
    objects: dict[str, str]  # fqn -> base64 of torch.save(value)
    event: Any = None  # torch.cuda.Event after the copies, or None (CPU: copied already)
    copied: threading.Event = field(default_factory=threading.Event)  # set once the host copies ran

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class SharedStager:
    """Copies a state dict into shared memory for the writer process (see the module docstring)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self._key: Any = None
        self._stream: Any = None
        self._pending: Any = None  # the last staging's CUDA event, until an update has waited for it
        self._serialized: dict[str, tuple[Any, str]] = {}  # fqn -> the last plain value sent (typed key)

    def stage(self, state: dict[str, Any]) -> Staged:
        staged, finish = self.stage_later(state)
        finish()
        return staged

    def stage_later(self, state: dict[str, Any]) -> tuple[Staged, Callable[[], None]]:
        """The layout now; the copies and the serialized values when the returned call runs (on CPU,
        the memory tier runs it in a thread while the next step's forward and backward run: they
        change none of the state's tensors, and the optimizer waits for it, ``Staged.copied``).
        On CUDA the copies are queued here, as ``stage`` does."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, mappings = flatten_state_dict(state)
        tensors: list[tuple[str, torch.Tensor, list[int] | None, list[int] | None]] = []
        values: dict[str, Any] = {}
        for fqn, obj in flat.items():
            if is_dtensor(obj):
                if obj.device_mesh.get_coordinate() is None:
                    continue  # not on this rank's part of the mesh: DCP skips it too
                tensors.append((fqn, obj.to_local(), list(obj.shape), _chunk_offsets(obj)))
            elif isinstance(obj, torch.Tensor):
                tensors.append((fqn, obj, None, None))
            else:
                values[fqn] = obj
        key = (
            tuple((f, t.dtype, tuple(t.shape), g and tuple(g), o and tuple(o)) for f, t, g, o in tensors),
            tuple((k, tuple(v)) for k, v in mappings.items()),
        )
        cuda = any(t.is_cuda for _, t, _, _ in tensors)
        if key != self._key or self.layout is None:
            self._new_layout(tensors, mappings, pin=cuda)
            self._key = key
        assert self.layout is not None
        layout = self.layout
        staged = Staged(layout, {})
        sources = [t for _, t, _, _ in tensors]
        if cuda:
            staged.event = self._copy(sources, layout.views, cuda)

        def finish() -> None:
            if not cuda:
                self._copy(sources, layout.views, cuda)
            staged.objects.update({fqn: self._serialize(fqn, v) for fqn, v in values.items()})
            staged.copied.set()

        return staged, finish

    def _new_layout(
        self,
        tensors: list[tuple[str, torch.Tensor, list[int] | None, list[int] | None]],
        mappings: dict[str, Any],
        *,
        pin: bool,
    ) -> None:
        slots, offset = [], 0
        for fqn, t, global_shape, chunk in tensors:
            nbytes = t.numel() * t.element_size()
            slots.append(Slot(fqn, offset, nbytes, dtype_name(t.dtype), list(t.shape), global_shape, chunk))
            offset += -(-nbytes // ALIGN) * ALIGN
        if self.layout is not None:
            self.layout.close()
        paths = {k: list(v) for k, v in mappings.items()}
        self.layout = Layout(slots, paths, offset, pin=pin)

    def _copy(self, sources: list[torch.Tensor], views: list[torch.Tensor], cuda: bool) -> Any:
        if not cuda:
            for src, dst in zip(sources, views, strict=True):
                dst.copy_(src)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # the state as of the step just done
        with torch.cuda.stream(self._stream):
            for src, dst in zip(sources, views, strict=True):
                dst.copy_(src, non_blocking=src.is_cuda)
                if src.is_cuda:
                    src.record_stream(self._stream)  # not reused by the allocator before the copy
            event = torch.cuda.Event()
            event.record(self._stream)
        self._pending = event
        return event

    def before_update(self) -> None:
        """Before the optimizer changes the live tensors: the GPU (not the host) waits for the copies."""
        if self._pending is not None:
            torch.cuda.current_stream().wait_event(self._pending)
            self._pending = None

    def _serialize(self, fqn: str, obj: Any) -> str:
        """``torch.save(obj)`` as DCP would write it, base64; plain values (scalars, and tuples, lists
        and dicts of them: betas, a param group's indices, the Python RNG's state) are remembered,
        since the same values come back every save, and ``torch.save`` holds the GIL the training
        thread needs (0.9 ms a memory-tier snapshot of the tiny model, before)."""
        key = _plain_key(obj)
        known = self._serialized.get(fqn)
        if key is not None and known is not None and known[0] == key:
            return known[1]
        buf = io.BytesIO()
        torch.save(obj, buf)
        text = base64.b64encode(buf.getvalue()).decode("ascii")
        if key is not None:
            self._serialized[fqn] = (key, text)
        return text

    def close(self) -> None:
        if self.layout is not None:
            self.layout.close()
            self.layout = None
        self._key = None


def _plain_key(obj: Any) -> Any:
    """A comparable, typed form of a plain value (1 and True differ, a tuple and a list differ), or
    None when ``obj`` holds anything else (a tensor, an array: serialized every time)."""
    if isinstance(obj, _SCALARS):
        return (type(obj), obj)
    if isinstance(obj, (tuple, list)):
        if all(type(v) is int for v in obj):  # (the Python RNG's 625 words: one pass, no recursion)
            return (type(obj), int, tuple(obj))
        items = [_plain_key(v) for v in obj]
        return None if any(i is None for i in items) else (type(obj), tuple(items))
    if isinstance(obj, dict):
        pairs = [(_plain_key(k), _plain_key(v)) for k, v in obj.items()]
        return None if any(k is None or v is None for k, v in pairs) else (dict, tuple(pairs))
    return None


def _chunk_offsets(dtensor: Any) -> list[int]:
    """Where this rank's shard starts in the whole tensor (what DCP records for a DTensor)."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor

    return [int(x) for x in _create_chunk_from_dtensor(dtensor).offsets]
