"""The token-range check runs once per dataset: a record of which shard files passed it.

Checking that every token id is below ``model.vocab_size`` reads every token shard in full, which
for a large corpus is minutes on every start. Once a shard has passed, its file's size and
modification time (ns) are recorded with the vocabulary size it passed for; a later start skips the
value check of every shard whose size and mtime are unchanged and whose record is for a vocabulary
at least as small (the headers, shapes and pairing are still checked every time: they are cheap).

The record lives next to the data when that directory is writable
(``<token_dir>/.hpclaunch-token-check.json``, shared by every run that reads the dataset) and in
the run directory otherwise (``RUN/data_check.json``). Both hold the same format, keyed by the
token directory's absolute path. Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .format import DatasetInfo

DATA_RECORD_NAME = ".hpclaunch-token-check.json"
RUN_RECORD_NAME = "data_check.json"
VERSION = 1


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` whole (readers never see half a record)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _signature(path: Path) -> list[int]:
    st = path.stat()
    return [int(st.st_size), int(st.st_mtime_ns)]


def _locations(token_dir: Path, run_dir: Path | None) -> list[Path]:
    places = [token_dir / DATA_RECORD_NAME]
    if run_dir is not None:
        places.append(run_dir / RUN_RECORD_NAME)
    return places


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(data, dict)
        or data.get("version") != VERSION
        or not isinstance(data.get("datasets"), dict)
    ):
        return {}
    return data


def known_good(token_dir: str | Path, vocab_size: int, run_dir: Path | None = None) -> set[str]:
    """Token files (absolute paths) whose values a record vouches for at ``vocab_size``."""
    token_dir = Path(token_dir).resolve()
    good: set[str] = set()
    for place in _locations(token_dir, run_dir):
        entry = _read(place).get("datasets", {}).get(str(token_dir))
        if not isinstance(entry, dict) or int(entry.get("vocab_size", 1 << 62)) > vocab_size:
            continue
        for name, sig in (entry.get("shards") or {}).items():
            path = token_dir / name
            try:
                if [int(x) for x in sig] == _signature(path):
                    good.add(str(path))
            except (OSError, TypeError, ValueError):
                continue
    return good


def record(
    info: DatasetInfo, token_dir: str | Path, vocab_size: int, run_dir: Path | None = None
) -> Path | None:
    """Record that every shard of ``info`` passed at ``vocab_size``; return where (None: nowhere writable)."""
    token_dir = Path(token_dir).resolve()
    shards = {}
    for s in info.shards:
        try:
            shards[s.token_path.name] = _signature(s.token_path)
        except OSError:
            continue
    for place in _locations(token_dir, run_dir):
        data = _read(place) or {"version": VERSION, "datasets": {}}
        data["datasets"][str(token_dir)] = {"vocab_size": vocab_size, "shards": shards}
        try:
            _write_json(place, data)
            return place
        except OSError:
            continue
    return None
