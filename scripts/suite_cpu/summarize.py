"""Sum a process-accounting file (``dump-acct``'s lines) by kind of process and by test module.

    python scripts/suite_cpu/summarize.py PACCT MAP

A process named ``<code>:<kind>`` (``name_process.pth``) counts for the module ``code`` stands for
in MAP (``tag_plugin.py``); ``p:`` is the suite's own (the xdist workers, mypy, ...); a process of
the OpenPBS jobs' user (not root) counts as "OpenPBS jobs" (PBS passes the environment not on).
A ``*`` after a kind: forked without exec (a rank forked from its rank host, a forked writer)."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def main(pacct: str, mapping: str) -> None:
    lines = Path(mapping).read_text().splitlines()
    codes = dict(line.split(" ", 1) for line in lines if " " in line)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_module: dict[str, float] = defaultdict(float)
    dump = subprocess.run(["dump-acct", pacct], capture_output=True, text=True, check=True).stdout
    for line in dump.splitlines():
        f = [x.strip() for x in line.split("|")]
        if len(f) < 12:
            continue
        comm, cpu, uid, forked = f[0], (float(f[2]) + float(f[3])) / 100, int(float(f[5])), "F" in f[11]
        code, _, kind = comm.partition(":") if ":" in comm else ("", "", comm)
        if uid >= 1000:
            kind, module = "OpenPBS jobs", "OpenPBS jobs (their user)"
        else:
            module = codes.get(code, "the suite's own" if code == "p" else "untagged")
        row = by_kind[kind + ("*" if forked else "")]
        row[0] += 1
        row[1] += cpu
        by_module[module] += cpu
    total = sum(by_module.values())
    print(f"total {total:.0f} core-s ({total / 60:.1f} core-min) in the processes that ended")
    print("\nby kind (core-s, processes):")
    for kind, (n, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:25]:
        print(f"{cpu:9.1f} {n:6d}  {kind}")
    print("\nby test module (core-s of the processes its tests started):")
    for module, cpu in sorted(by_module.items(), key=lambda kv: -kv[1])[:40]:
        print(f"{cpu:9.1f}  {module}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
