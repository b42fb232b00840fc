"""``python -m hpclaunch.trainer RUN_DIR``: what torchrun starts on every rank (see ``entry``)."""

import sys

from .entry import main

sys.exit(main())
