"""The checkpoint writer process: ``python -m hpclaunch.rank.checkpoint.writer_main SPEC``.

One per training rank (``writer_process``): forked by the rank before its first thread, torch
already imported, waiting for its first save (``main_forked``); or, where there is none waiting
(every writer after a failed save's), started with ``exec`` by a background save. Everything a
background save does after staging happens here, outside the training process's interpreter: DCP's
write (planned within the writers' own gloo group), the sha256 of this rank's files, and on rank 0
the manifest, the rename + directory fsync and retention (``writing.SaveWriter``, the same code a
blocking save runs in the training process). The training process loses only the staging copy:
no GIL, no thread of its own, and the writer's CPU time at a lower priority (``checkpoint.writer_nice``).

What it reads: a staging buffer (a file descriptor), and per save a JSON message with the job and
the non-tensor values as ``torch.save`` bytes, written into the checkpoint as they are, never
unpickled. A DTensor's shard arrives as a plain tensor with its place in the whole tensor
(``LocalShard``), planned by DCP exactly as the DTensor would be. It dies with the training thread
that started it (``PR_SET_PDEATHSIG``), and leaves when its channel closes. The scheduler's stop
signals do not end it (``rank.helper_signals``): it finishes the save in flight.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..helper_signals import die_with_parent, ignore_stop_signals
from . import channel
from .directory import CheckpointDir, EventBuffer
from .priority import lower_process_priority
from .save_plans import SavePlans
from .staging import Slot, dtype_of, map_fd
from .writer_protocol import Answer, Failed, Saved, SaveRequest, WriterSpec
from .writing import SaveJob, SaveWriter

log = logging.getLogger("hpclaunch.rank.checkpoint")
PR_SET_NAME = 15
GROUP_TIMEOUT_S = 1800  # a collective waits this long for a slow peer's write (gloo's default)


def main(argv: list[str]) -> int:
    """The writer started by ``exec``: its spec is its argument."""
    spec = WriterSpec.from_json(json.loads(argv[0]))
    ignore_stop_signals()  # a helper's policy: the scheduler's warning is the rank's to act on
    _die_with_parent(spec.parent)
    return run(spec, socket.socket(fileno=spec.fd))


def main_forked(sock: socket.socket, parent: int) -> int:
    """The writer forked by its rank before the rank's first thread (``writer_process.prefork``):
    torch is already imported; it waits for its spec, the first message, sent with the first save."""
    ignore_stop_signals()
    _die_with_parent(parent)
    try:
        message, _ = channel.recv(sock)
    except channel.ChannelClosed:
        return 0  # the rank never needed it
    if message.get("op") != "spec":
        return 0  # ("exit": the rank is done without a background save)
    spec = replace(WriterSpec.from_json(message["spec"]), fd=sock.fileno(), parent=parent)
    return run(spec, sock)


def run(spec: WriterSpec, sock: socket.socket) -> int:
    lower_process_priority(spec.nice, idle=spec.idle)
    _name_process()
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[checkpoint writer of rank {spec.rank}] %(name)s: %(message)s",
        force=True,  # (a forked writer has its rank's handlers)
    )
    log.setLevel(logging.INFO)
    import torch

    torch.set_num_threads(1)  # hashing and copies, beside the training threads
    # torch.save's CRC32 of every record: the manifest's sha256 of every file already guards the
    # bytes (and is what verification checks); torch.load does not need it. ~10 ms a save saved.
    torch.serialization.set_crc32_options(False)
    events = EventBuffer()
    directory = spec.checkpoints.directory
    writer = SaveWriter(
        CheckpointDir(spec.checkpoints, ledger=events),
        rank=spec.rank,
        plans=SavePlans(staged_planner_class()),
        pg=_join_group(spec),
        in_writer_process=True,
        write_threads=spec.write_threads,
    )
    return serve(sock, writer, events, directory)


def serve(sock: socket.socket, writer: SaveWriter, events: EventBuffer, directory: Path) -> int:
    layout: MappedLayout | None = None
    held: int | None = None
    while True:
        try:
            message, fds = channel.recv(sock)
        except channel.ChannelClosed:
            return 0  # the training process has gone
        op = message.get("op")
        if op == "layout":
            if layout is not None:
                layout.close()
            layout = MappedLayout(message, fds[0])
        elif op == "save":
            held = held if held is not None else _hold(directory)
            request = SaveRequest.from_json(message)
            assert layout is not None and layout.id == request.layout, "save before its layout"
            channel.send(sock, save(writer, layout, request, events).to_json())
        elif op == "exit":
            return 0


def save(writer: SaveWriter, layout: MappedLayout, request: SaveRequest, events: EventBuffer) -> Answer:
    """One save; the answer for the training process (never raises)."""
    job = request.job
    for name, value in request.hooks.items():  # test hooks as the training process saw them
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    begun, cpu = time.monotonic(), time.process_time()
    try:
        state = layout.state(request.objects)
        published = writer.write_and_publish(job, state)
    except CheckpointError as e:
        return _failed(job, e.message, e.where, e.hint, events)
    except Exception as e:  # the answer must go back whatever happened
        log.exception("saving step %d failed", job.step)
        return _failed(job, f"the checkpoint writer failed: {type(e).__name__}: {e}", None, None, events)
    return Saved(
        job.step,
        published,
        time.monotonic() - begun,
        time.process_time() - cpu,  # this writer's CPU time for the save (bench)
        events.drain(),
    )


def _failed(job: SaveJob, message: str, where: str | None, hint: str | None, events: EventBuffer) -> Failed:
    return Failed(message, job.step, where, hint, events.drain())


class MappedLayout:
    """The staging buffer as the writer sees it: a plain tensor per slot, no copy."""

    def __init__(self, message: dict[str, Any], fd: int) -> None:
        import torch

        self.id = str(message["id"])
        self.mappings = {k: tuple(v) for k, v in message["mappings"].items()}
        self._mm = map_fd(fd, int(message["nbytes"]))
        os.close(fd)
        view = memoryview(self._mm)
        self.tensors: dict[str, Any] = {}
        for raw in message["slots"]:
            slot = Slot(**raw)
            dtype = dtype_of(slot.dtype)
            if slot.nbytes:  # a tensor whose storage is exactly its bytes: DCP writes it as it is
                t = torch.frombuffer(view[slot.offset : slot.offset + slot.nbytes], dtype=dtype)
                t = t.reshape(slot.shape)
            else:
                t = torch.empty(slot.shape, dtype=dtype)
            if slot.global_shape is not None and slot.chunk_offsets is not None:
                self.tensors[slot.fqn] = LocalShard(t, slot.global_shape, slot.chunk_offsets)
            else:
                self.tensors[slot.fqn] = t

    def state(self, objects: dict[str, str]) -> dict[str, Any]:
        """The state dict of one save, nested again as the training process had it (DCP wraps every
        top-level key in its call logging, which costs per call: a flat dict of hundreds of keys
        took ~30 ms of the writer's CPU per save). DCP's planner flattens it back to the same keys."""
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

        flat: dict[str, Any] = {}
        for fqn in self.mappings:
            if fqn in self.tensors:
                flat[fqn] = self.tensors[fqn]
            elif fqn in objects:
                flat[fqn] = Serialized(base64.b64decode(objects[fqn]))
        mappings = {fqn: path for fqn, path in self.mappings.items() if fqn in flat}
        return dict(unflatten_state_dict(flat, mappings))

    def close(self) -> None:
        self.tensors = {}
        with contextlib.suppress(BufferError):  # a tensor still refers to it: freed with it
            self._mm.close()


class Serialized:
    """A value the training process serialized with ``torch.save``: written as these bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class LocalShard:
    """A DTensor's local shard without its mesh: DCP plans it through the same hooks DTensor has."""

    def __init__(self, local: Any, global_shape: list[int], offsets: list[int]) -> None:
        self.local = local
        self.global_shape = global_shape
        self.offsets = offsets

    def _chunk(self) -> Any:
        import torch
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        import torch
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self.local),
                    size=torch.Size(self.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: Any) -> Any:
        return self.local


def staged_planner_class() -> type[Any]:
    """DCP's default save planner over a staged state: its shards are ``LocalShard`` and its values
    ``Serialized``."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class StagedSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, LocalShard):
                return obj.local
            if isinstance(obj, Serialized):
                return obj
            return super().lookup_object(index)

        def transform_object(self, write_item: Any, object: Any) -> Any:
            if isinstance(object, Serialized):
                return io.BytesIO(object.data)
            return super().transform_object(write_item, object)

    return StagedSavePlanner


def _join_group(spec: WriterSpec) -> Any:
    """The writers' own gloo group, through the ranks' store under this generation's prefix."""
    if spec.checkpoints.world_size == 1:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    assert spec.store is not None  # (store_address gives every run of several ranks one)
    host, port = spec.store
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"hpclaunch/checkpoint-writers/{spec.generation}/", store),
        rank=spec.rank,
        world_size=spec.checkpoints.world_size,
        timeout=timeout,
    )
    return dist.group.WORLD


PROCESS_NAME = b"hpcl-ckpt-write"  # (15 bytes: the kernel's limit)


def _name_process() -> None:
    """Name this process ``hpcl-ckpt-write`` (``/proc/PID/comm``, what ``top`` and ``ps -o comm``
    show): a forked writer's command line is its rank's."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(PROCESS_NAME), 0, 0, 0)


def _hold(directory: Path) -> int | None:
    """Keep the checkpoint directory open while serving: ``ls -l /proc/PID/fd`` of a writer then says
    which run's checkpoints it writes (a forked writer's command line does not)."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the thread that started it dies (Linux); a parent already gone ends
    it now. Elsewhere the closed channel ends it between saves."""
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


def leave(code: int) -> None:
    """Every save was answered and every file it wrote is closed: leave without the interpreter's
    teardown (with torch and DCP loaded it takes about a second, and the rank waits for it; a
    forked writer must never run its rank's)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
