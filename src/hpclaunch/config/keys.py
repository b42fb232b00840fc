"""Keys that changed since a release: renamed ones are read under their new name (``RENAMED_KEYS``),
retired ones are dropped from a run directory's own config and explained to a user who gives one
(``RETIRED_KEYS``)."""

from __future__ import annotations

from typing import Any

# Keys renamed since a release: the old name is read as the new one (``RENAMED_KEYS``: dotted).
_RENAMED_IN_SCHEDULER = {"cpus_per_task": "cpus_per_node"}
RENAMED_KEYS = {f"scheduler.{old}": f"scheduler.{new}" for old, new in _RENAMED_IN_SCHEDULER.items()}


# Keys that existed once and were removed: a run directory written before keeps them in its
# config.yaml (dropped when it is read: ``drop_retired``); a user's file or --set is told why.
RETIRED_KEYS = {
    (
        "launch",
        "shutdown_timeout_s",
    ): "it was read by nothing (the rank host's elastic launch stops the ranks)",
}


def drop_retired(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without the retired keys (a run's own config, written by an older version)."""
    for section, key in RETIRED_KEYS:
        part = raw.get(section)
        if isinstance(part, dict):
            part.pop(key, None)
    return raw
