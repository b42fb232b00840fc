"""The torch-free half of hpclaunch.rank.checkpoint: names, manifest checks, scan, retention.

Checkpoint directories are built by hand here (as a writer or an attacker would), so these tests
pin the on-disk contract independently of DCP.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpclaunch.rank.checkpoint import (
    MANIFEST_NAME,
    build_manifest,
    file_digest,
    scan_checkpoints,
    step_dir_name,
    steps_to_delete,
)


def make_checkpoint(root: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A published-looking checkpoint with a correct manifest."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    files = files or {".metadata": b"meta", "__0_0.distcp": b"x" * 100, "__1_0.distcp": b"y" * 50}
    for name, data in files.items():
        (path / name).write_bytes(data)
    digests = {name: file_digest(path / name) for name in files}
    manifest = build_manifest(
        step=step, world_size=2, config_hash="c", model_hash="m", extra={"k": 1}, files=digests
    )
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def reasons(root: Path) -> dict[str, str]:
    return {p.name: r for p, r in scan_checkpoints(root)[1]}


def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys, hpclaunch.rundir.checkpoint_manifest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_step_directory_names_are_zero_padded_to_six_digits_or_more() -> None:
    assert step_dir_name(123) == "step_000123"
    assert step_dir_name(0) == "step_000000"
    assert step_dir_name(12_345_678) == "step_12345678"


def test_manifest_records_versions_hashes_and_every_file(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 7)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1
    assert (manifest["step"], manifest["world_size"]) == (7, 2)
    assert (manifest["config_hash"], manifest["model_hash"]) == ("c", "m")
    assert manifest["hpclaunch_version"] and manifest["created"]
    assert manifest["extra"] == {"k": 1}
    assert manifest["files"]["__0_0.distcp"]["bytes"] == 100
    assert len(manifest["files"]["__0_0.distcp"]["sha256"]) == 64
    assert manifest["total_bytes"] == 4 + 100 + 50


def test_scan_lists_valid_checkpoints_oldest_first(tmp_path: Path) -> None:
    for step in (30, 10, 20):
        make_checkpoint(tmp_path, step)
    valid, invalid = scan_checkpoints(tmp_path)
    assert [info.step for info in valid] == [10, 20, 30]
    assert invalid == []
    assert scan_checkpoints(tmp_path / "missing") == ([], [])


def test_scan_names_the_reason_for_each_invalid_checkpoint(tmp_path: Path) -> None:
    truncated = make_checkpoint(tmp_path, 1)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 60)
    altered = make_checkpoint(tmp_path, 2)
    (altered / "__1_0.distcp").write_bytes(b"z" * 50)
    no_manifest = make_checkpoint(tmp_path, 3)
    (no_manifest / MANIFEST_NAME).unlink()
    missing = make_checkpoint(tmp_path, 4)
    (missing / "__1_0.distcp").unlink()
    extra = make_checkpoint(tmp_path, 5)
    (extra / "__2_0.distcp").write_bytes(b"intruder")
    bad_json = make_checkpoint(tmp_path, 6)
    (bad_json / MANIFEST_NAME).write_text("{not json")
    wrong_step = make_checkpoint(tmp_path, 7)
    (wrong_step.parent / step_dir_name(8)).mkdir()
    for child in wrong_step.iterdir():
        child.rename(wrong_step.parent / step_dir_name(8) / child.name)
    no_metadata = make_checkpoint(tmp_path, 9, {"__0_0.distcp": b"x"})
    (tmp_path / ".step_000010.tmp-abc123").mkdir()

    got = reasons(tmp_path)
    assert got["step_000001"] == "file __0_0.distcp is 60 bytes, manifest says 100 (truncated?)"
    assert got["step_000002"] == "sha256 mismatch in __1_0.distcp (altered after it was written)"
    assert got["step_000003"] == "no manifest.json (the writer was killed before publishing)"
    assert got["step_000004"] == "file __1_0.distcp is missing"
    assert got["step_000005"] == "unlisted file __2_0.distcp (not part of this checkpoint)"
    assert got["step_000006"].startswith("manifest.json is not valid JSON")
    assert got["step_000007"] == "no manifest.json (the writer was killed before publishing)"
    assert got["step_000008"] == "manifest says step 7, directory says 8"
    assert got[no_metadata.name] == "manifest does not list .metadata (DCP did not finish)"
    assert got[".step_000010.tmp-abc123"].startswith("never published")


def test_manifest_cannot_point_outside_its_directory(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 1)
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    manifest["files"]["../../etc/passwd"] = {"bytes": 1, "sha256": "0" * 64}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert reasons(tmp_path)["step_000001"].startswith("manifest lists an invalid file name")


def test_scan_without_hashes_checks_sizes_only(tmp_path: Path) -> None:
    altered = make_checkpoint(tmp_path, 1)
    (altered / "__1_0.distcp").write_bytes(b"z" * 50)
    assert [i.step for i in scan_checkpoints(tmp_path, verify_hashes=False)[0]] == [1]
    assert scan_checkpoints(tmp_path)[0] == []


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "protect", "deleted"),
    [
        ([1, 2, 3, 4, 5], 2, None, [], [1, 2, 3]),
        ([1, 2, 3, 4, 5, 6, 7], 2, 3, [], [1, 2, 4, 5]),
        ([10, 20, 30], 1, None, [10], [20]),
        ([5], 1, None, [], []),
    ],
)
def test_retention_keeps_last_k_every_nth_and_protected(
    steps: list[int], keep_last: int, keep_every: int | None, protect: list[int], deleted: list[int]
) -> None:
    got = steps_to_delete(steps, keep_last=keep_last, keep_every=keep_every, protect=protect)
    assert got == deleted
