"""``python -m hpclaunch.trainer RUN_DIR``: what torchrun starts on every rank (see ``loop``)."""

import sys

from .loop import main

sys.exit(main())
