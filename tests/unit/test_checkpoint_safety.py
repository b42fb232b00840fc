"""Loading never unpickles arbitrary objects, even when an attacker also rewrites the manifest."""

from __future__ import annotations

import io
import json
import pickle
import pickletools
from pathlib import Path
from typing import Any

import pytest
import torch

from hpclaunch.errors import CheckpointError
from hpclaunch.rank.checkpoint import (
    MANIFEST_NAME,
    Checkpointer,
    RunCheckpoints,
    file_digest,
    load_metadata_safely,
    scan_checkpoints,
)

pytestmark = pytest.mark.fast


class MakesMarker:
    """Unpickling this calls ``open(marker, "w")``: creates a file, as arbitrary code would."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def make(tmp_path: Path) -> Checkpointer:
    return Checkpointer(
        RunCheckpoints(tmp_path / "ckpt", 1, config_hash="c", model_hash="m", keep_last=5), rank=0
    )


def rewrite_manifest(path: Path) -> None:
    """What an attacker does after editing files: make the manifest match again."""
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    for name in manifest["files"]:
        size, sha = file_digest(path / name)
        manifest["files"][name] = {"bytes": size, "sha256": sha}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_malicious_metadata_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(MakesMarker(marker))
    pickle.loads(payload)  # control: plain pickle (what DCP uses) runs it
    assert marker.exists()
    marker.unlink()

    make(tmp_path).save(1, {"w": torch.ones(4)}, blocking=True)
    path = tmp_path / "ckpt" / "step_000001"
    (path / ".metadata").write_bytes(payload)
    rewrite_manifest(path)
    assert [i.step for i in scan_checkpoints(tmp_path / "ckpt")[0]] == [1]  # looks valid

    with pytest.raises(CheckpointError) as err:
        make(tmp_path).load_latest({"w": torch.zeros(4)})
    text = str(err.value)
    assert text.startswith(str(path / ".metadata") + ": refusing to unpickle io.open")
    assert not marker.exists()


def test_malicious_non_tensor_item_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # The crafted object is saved as a DCP bytes item; the manifest matches by construction.
    make(tmp_path).save(1, {"w": torch.ones(4), "evil": MakesMarker(marker)}, blocking=True)
    assert not marker.exists()

    with pytest.raises(CheckpointError) as err:
        make(tmp_path).load_latest({"w": torch.zeros(4), "evil": None})
    text = str(err.value)
    assert "step_000001/__0_0.distcp (item evil): refusing to unpickle" in text
    assert "open" in text
    assert not marker.exists()


def test_dotted_names_of_allowed_classes_are_refused(tmp_path: Path) -> None:
    # Protocol 4 resolves "PosixPath.touch" by attribute lookup: an exact-match allow-list
    # must not let it through just because PosixPath itself is allowed.
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=4)
    pickler.dump(None)
    body = (
        b"\x80\x04\x8c\x07pathlib\x8c\x0fPosixPath.touch\x93"  # STACK_GLOBAL
        b"\x8c\x07pathlib\x8c\tPosixPath\x93\x8c\x01x\x85R\x85R."  # touch(PosixPath("x"))
    )
    pickletools.dis(body, out=io.StringIO())  # well-formed
    bad = tmp_path / ".metadata"
    bad.write_bytes(body)
    with pytest.raises(CheckpointError, match=r"refusing to unpickle pathlib\.PosixPath\.touch"):
        load_metadata_safely(bad)
    assert not (Path.cwd() / "x").exists()


def test_real_metadata_of_a_model_and_adamw_passes_the_allow_list(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(3, dtype=torch.int32)}
    make(tmp_path).save(3, state, blocking=True)
    metadata = load_metadata_safely(tmp_path / "ckpt" / "step_000003" / ".metadata")
    assert "optim.param_groups.0.betas" in metadata.state_dict_metadata
    assert make(tmp_path).load_latest(state) is not None
