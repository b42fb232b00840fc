"""``python -m hpclaunch.trainer RUN_DIR``: one rank of the built-in trainer started as a process
(by hand, or under a plain torchrun); the rank host forks its ranks into ``entry`` instead.

Once ``main`` has returned, everything the rank writes is written and closed (outcome, metrics,
checkpoints, TensorBoard, the process group), so the rank leaves with ``os._exit`` instead of the
interpreter's teardown: with torch, mmdit and DCP loaded that teardown takes ~0.9 s on a 2-core
machine (``bench/restart_cost.py`` prints it), and every stop and restart waits for the slowest
rank to exit. An exception that escapes ``main`` still exits the ordinary way, with its traceback.
"""

import contextlib
import os
import sys

from .entry import main

code = main()
for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to say there
        stream.flush()
os._exit(code)
