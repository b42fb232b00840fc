"""Validation of NCCL and torch-distributed variables: removed names, unknown values, contradictions.

NCCL silently ignores values it does not understand (``NCCL_NET_GDR_LEVEL=PBH``) and still reads
nothing from variables it removed years ago (``NCCL_TREE_THRESHOLD``), so hpclaunch checks them
itself, against the tables of ``variables`` (names and value kinds from libnccl 2.32.3 and torch 2.13).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .variables import (
    ALGOS,
    DEBUG_LEVELS,
    DEPRECATED,
    FUNCS,
    KNOWN_VARIABLES,
    LEVELS,
    OURS,
    PASS_THROUGH_PREFIXES,
    PROTOS,
    REMOVED,
    SUBSYSTEMS,
    VarSpec,
)

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class NcclIssue:
    """One finding about one variable. Errors are certainly wrong; warnings are doubtful."""

    name: str
    severity: Severity
    message: str
    replacement: str | None = None

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


_INT_RE = re.compile(r"^[+-]?(?:0[xX][0-9a-fA-F]+|\d+)$")
_TORCH_TRUE = ("y", "yes", "1", "t", "true")
_TORCH_FALSE = ("n", "no", "0", "f", "false")


def validate_nccl_env(env: Mapping[str, str]) -> list[NcclIssue]:
    """Issues with the NCCL / torch-distributed variables in ``env`` (errors first, then warnings)."""
    issues: list[NcclIssue] = []
    for name, value in env.items():
        issues.extend(_check_one(name, str(value)))
    issues.extend(_check_combinations(env))
    return sorted(issues, key=lambda i: i.severity != "error")


def _check_one(name: str, value: str) -> list[NcclIssue]:
    if name in REMOVED:
        why, use = REMOVED[name]
        msg = why + (f"; use {use}" if use else "")
        return [NcclIssue(name, "error", msg, use)]
    if name in DEPRECATED:
        new = DEPRECATED[name]
        issue = NcclIssue(name, "warning", f"is a deprecated alias; rename it to {new}", new)
        return [issue, *(_check_value(name, value, KNOWN_VARIABLES[new]) if new in KNOWN_VARIABLES else [])]
    spec = KNOWN_VARIABLES.get(name)
    if spec is not None:
        return _check_value(name, value, spec)
    if name == "RDMAV_FORK_SAFE":
        return [
            NcclIssue(
                name, "warning", "aws-ofi-nccl advises never to set it (EFA is fork-safe by itself)", None
            )
        ]
    if name.startswith(OURS):
        close = _close_name(name)
        if close:
            return [
                NcclIssue(
                    name, "error", f"is not a variable NCCL or torch reads (did you mean {close}?)", close
                )
            ]
        return [
            NcclIssue(
                name,
                "warning",
                "is not known to NCCL 2.32 / torch 2.13 (newer, or misspelled?); unknown names are ignored",
                None,
            )
        ]
    if name.startswith(PASS_THROUGH_PREFIXES):
        return []
    return [
        NcclIssue(
            name,
            "warning",
            "is not an NCCL/torch-distributed variable; general variables go in launch.env",
            None,
        )
    ]


def _close_name(name: str) -> str | None:
    known = [*KNOWN_VARIABLES, *DEPRECATED]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
    return close[0] if close else None


def _check_value(name: str, value: str, spec: VarSpec) -> list[NcclIssue]:
    def err(msg: str, replacement: str | None = None) -> list[NcclIssue]:
        return [NcclIssue(name, "error", msg, replacement)]

    def warn(msg: str, replacement: str | None = None) -> list[NcclIssue]:
        return [NcclIssue(name, "warning", msg, replacement)]

    v = value.strip()
    if v == "":
        return warn("is empty; NCCL/torch treat it as unset or as 0")
    if spec.kind == "int":
        n = _parse_int(v)
        if n is None:
            return err(f"{value!r} is not an integer; NCCL ignores it and keeps its default")
        if (spec.lo is not None and n < spec.lo) or (spec.hi is not None and n > spec.hi):
            rng = f"{spec.lo if spec.lo is not None else '-inf'}..{spec.hi if spec.hi is not None else 'inf'}"
            return err(f"{n} is outside {rng}" + (f" ({spec.note})" if spec.note else ""))
        return []
    if spec.kind == "bool":
        n = _parse_int(v)
        if n is not None:
            return [] if n in (0, 1) else warn(f"{value!r}: use 0 or 1 (any non-zero reads as 1)")
        if v.upper() in ("T", "TRUE", "F", "FALSE"):
            one = "1" if v.upper().startswith("T") else "0"
            return warn(
                f"{value!r} is read by recent NCCL (2.32) only; older releases ignore it: write {one}", one
            )
        return err(f"{value!r} is not 0 or 1; NCCL ignores it and keeps its default")
    if spec.kind == "torch_bool":
        if v.lower() in _TORCH_TRUE or v.lower() in _TORCH_FALSE:
            return []
        return err(f"{value!r} is not a boolean torch accepts (0/1, true/false, yes/no); torch refuses it")
    if spec.kind == "enum":
        return _check_enum(name, v, spec)
    if spec.kind == "level":
        return _check_level(name, v)
    if spec.kind == "debug":
        if v.upper() in DEBUG_LEVELS:
            return []
        close = _suggest(v.upper(), DEBUG_LEVELS)
        return err(
            f"{value!r} is not a level ({'/'.join(DEBUG_LEVELS[:5])})"
            + (f" (did you mean {close}?)" if close else "")
            + "; NCCL ignores it and logs nothing",
            close,
        )
    if spec.kind == "subsys":
        items = [t.strip() for t in v.lstrip("^").split(",")]
        bad = [t for t in items if t.upper() not in SUBSYSTEMS]
        if bad:
            close = _suggest(bad[0].upper(), SUBSYSTEMS)
            return err(
                f"unknown subsystem(s) {', '.join(bad)}"
                + (f" (did you mean {close}?)" if close else "")
                + f"; known: {', '.join(SUBSYSTEMS)}"
            )
        return []
    if spec.kind in ("algo", "proto"):
        return _check_algo_list(name, v, ALGOS if spec.kind == "algo" else PROTOS)
    if spec.kind == "path":
        if v.startswith("~"):
            return warn(f"{value!r}: '~' is not expanded here; use an absolute path")
        return []
    return []


def _check_enum(name: str, v: str, spec: VarSpec) -> list[NcclIssue]:
    allowed = spec.values
    if v in allowed or (not spec.case_sensitive and v.upper() in (a.upper() for a in allowed)):
        return []
    close = _suggest(v.upper(), allowed)
    extra = f" ({spec.note})" if spec.note else ""
    return [
        NcclIssue(
            name,
            "error",
            f"{v!r} is not one of {', '.join(allowed)}"
            + (f" (did you mean {close}?)" if close else "")
            + extra,
            close,
        )
    ]


def _check_level(name: str, v: str) -> list[NcclIssue]:
    if v in LEVELS:
        return []
    if v[:1].isdigit():
        n = _parse_int(v)
        if n is not None and n <= 5:
            return []
        return [
            NcclIssue(
                name, "warning", f"{v!r}: legacy numeric levels are 0..5 (larger reads as SYS); use a name"
            )
        ]
    close = _suggest(v.upper(), LEVELS)
    if v.upper() in LEVELS:
        why = "NCCL compares level names case-sensitively"
    else:
        why = f"levels are {' '.join(LEVELS)}"
    return [
        NcclIssue(
            name,
            "error",
            f"{v!r} is not a level NCCL knows"
            + (f" (did you mean {close}?)" if close else "")
            + f"; {why}, and NCCL silently ignores anything else",
            close,
        )
    ]


def _check_algo_list(name: str, v: str, names: tuple[str, ...]) -> list[NcclIssue]:
    """``Ring,Tree`` / ``^Tree`` / (NCCL >= 2.24) ``allreduce:tree,ring;broadcast:ring``."""
    lower = {n.lower(): n for n in names}
    funcs = {f.lower() for f in FUNCS}
    bad: list[str] = []
    for part in filter(None, (p.strip() for p in v.split(";"))):
        func, sep, items = part.rpartition(":")
        if sep and func.strip().lower() not in funcs:
            bad.append(func.strip())
        for tok in items.lstrip("^").split(","):
            tok = tok.strip()
            if tok and tok.lower() not in lower:
                bad.append(tok)
    if not bad:
        return []
    close = _suggest(bad[0], names)
    return [
        NcclIssue(
            name,
            "error",
            f"unknown name(s) {', '.join(repr(b) for b in bad)}"
            + (f" (did you mean {close}?)" if close else "")
            + f"; allowed: {', '.join(names)} (optionally per collective, e.g. allreduce:ring,tree)",
            close,
        )
    ]


def _parse_int(v: str) -> int | None:
    """An integer as C's strtoll(base 0) reads it whole (0x1f hex, 017 octal), else None."""
    if not _INT_RE.fullmatch(v):
        return None
    sign, digits = (v[0], v[1:]) if v[0] in "+-" else ("", v)
    try:
        if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xX":
            return int(sign + digits, 8)
        return int(sign + digits, 0)
    except ValueError:
        return None


def _suggest(word: str, allowed: tuple[str, ...]) -> str | None:
    """Case-insensitive match, then a transposition (PBH -> PHB), then difflib."""
    for a in allowed:
        if a.upper() == word.upper():
            return a
    for a in allowed:
        if len(a) == len(word) and sorted(a.upper()) == sorted(word.upper()):
            return a
    close = difflib.get_close_matches(word.upper(), [a.upper() for a in allowed], n=1, cutoff=0.6)
    if close:
        return next(a for a in allowed if a.upper() == close[0])
    return None


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "y", "yes", "t", "true")


def _check_combinations(env: Mapping[str, str]) -> list[NcclIssue]:
    out: list[NcclIssue] = []
    for old, new in DEPRECATED.items():
        if old in env and new in env:
            out.append(NcclIssue(old, "warning", f"is ignored because {new} is also set; remove it", new))
    if env.get("NCCL_P2P_DISABLE", "").strip() == "1" and "NCCL_P2P_LEVEL" in env:
        out.append(
            NcclIssue("NCCL_P2P_LEVEL", "warning", "has no effect: NCCL_P2P_DISABLE=1 forces LOC", None)
        )
    if env.get("NCCL_IB_DISABLE", "").strip() == "1":
        ib = sorted(k for k in env if k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE")
        if ib:
            out.append(
                NcclIssue(ib[0], "warning", f"{', '.join(ib)} have no effect with NCCL_IB_DISABLE=1", None)
            )
    buf = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if _truthy(env.get("TORCH_NCCL_DUMP_ON_TIMEOUT")) and buf is not None and buf.strip() == "0":
        out.append(
            NcclIssue(
                "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "warning",
                "dumps nothing with TORCH_FR_BUFFER_SIZE=0 (the flight recorder is off)",
                None,
            )
        )
    if _truthy(env.get("TORCH_NCCL_DESYNC_DEBUG")) and env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "0":
        out.append(
            NcclIssue(
                "TORCH_NCCL_DESYNC_DEBUG",
                "warning",
                "needs TORCH_NCCL_ASYNC_ERROR_HANDLING != 0 to report anything",
                None,
            )
        )
    return out
