"""Loading a checkpoint without unpickling arbitrary objects.

DCP's ``.metadata`` goes through an allow-list unpickler (the classes DCP metadata actually
contains); non-tensor items through ``torch.load(weights_only=True)``; the reader and planner
subclasses hand DCP what was read safely and tolerate missing rank-local keys. Anything else raises
``CheckpointError`` naming the file and the class.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from pathlib import Path
from typing import IO, Any, NamedTuple

from ...errors import CheckpointError
from ...rundir.checkpoint_manifest import _is_optional

# (Found by recording find_class while unpickling the .metadata of a DDP model + AdamW state with
# every dtype and memory format we use.)

_METADATA_ALLOWED = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # maps a layout name to torch.strided etc.
        ("torch", "Size"),
        # StorageMeta.checkpoint_id is the directory DCP wrote to.
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only allow-listed DCP metadata classes and torch dtype/layout constants."""

    def __init__(self, file: IO[bytes], where: Path):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # Exact (module, name) match: dotted names like "PosixPath.touch" are refused too.
        if (module, name) in _METADATA_ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and _is_torch_constant(name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"refusing to unpickle {module}.{name}: not a DCP metadata class "
            "(the file was altered or is not a DCP checkpoint)",
            where=str(self.where),
        )


def _is_torch_constant(name: str) -> bool:
    import torch

    value = getattr(torch, name, None)
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


def load_metadata_safely(path: Path) -> Any:
    """DCP's Metadata from a ``.metadata`` file, through the allow-list unpickler."""
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError("no .metadata file", where=str(path)) from None
    except Exception as e:
        raise CheckpointError(
            f"cannot read DCP metadata ({type(e).__name__}: {e})", where=str(path)
        ) from None


_UNSUPPORTED_GLOBAL_RE = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def load_item_safely(data: IO[bytes], where: str) -> Any:
    """One non-tensor DCP item, via ``torch.load(weights_only=True)`` (never plain pickle)."""
    import torch

    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _UNSUPPORTED_GLOBAL_RE.search(str(e))
        what = found.group(1) if found else str(e).splitlines()[0]
        raise CheckpointError(
            f"refusing to unpickle {what}: only tensors and plain values are allowed "
            "(the file was altered, or the trainer saved an object that is not a plain value)",
            where=where,
        ) from None


class SafeLoadParts(NamedTuple):
    reader: type[Any]
    planner: type[Any]


@functools.cache
def safe_load_parts() -> SafeLoadParts:
    """The DCP reader and planner subclasses; defined on first use so torch loads lazily."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

    class SafeReader(dcp.FileSystemReader):
        """FileSystemReader that hands DCP metadata we already read through the allow-list
        unpickler (read before dcp.load, so a refusal is not buried in DCP's fallbacks)."""

        def __init__(self, path: Path, metadata: Metadata) -> None:
            super().__init__(path)
            self.metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            storage_meta = self.metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            self.metadata.storage_meta = storage_meta
            return self.metadata

        def file_of(self, read_item: ReadItem) -> str:
            return str(self.storage_data[read_item.storage_index].relative_path)

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        """Loads non-tensor items with weights_only=True; tolerates missing keys of the optional
        sections (RANK_LOCAL, ema)."""

        def __init__(self, reader: SafeReader, where: Path) -> None:
            super().__init__(allow_partial_load=False)
            self.reader = reader
            self.where = where
            self.saved_keys: list[str] = []

        def create_local_plan(self) -> LoadPlan:
            # Replaces DefaultLoadPlanner's version sniffing (for pre-2.4 checkpoints, which we
            # never write): it would re-add the rank-local keys we drop here.
            assert self.metadata is not None
            saved = self.metadata.state_dict_metadata
            self.saved_keys = list(saved)
            missing = [k for k in self.state_dict if k not in saved]
            required = [k for k in missing if not _is_optional(k)]
            if required:
                shown = ", ".join(sorted(required)[:5]) + (" ..." if len(required) > 5 else "")
                raise CheckpointError(
                    f"lacks {len(required)} key(s) this trainer needs: {shown} "
                    "(state layout changed; start a new run or restore the old code)",
                    where=str(self.where),
                )
            for key in missing:  # optional entries this checkpoint lacks: keep the caller's
                del self.state_dict[key]
            return create_default_local_load_plan(self.state_dict, self.metadata, True)

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            where = f"{self.where / self.reader.file_of(read_item)} (item {fqn})"
            obj = load_item_safely(value, where)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadParts(reader=SafeReader, planner=SafeLoadPlanner)
