"""What the rank host imports once per allocation for a script's run, before it forks its
forkserver (``host.PRELOAD``): torch, its distributed pieces a script and the run use (DCP and its
state-dict helpers, FSDP2, DDP, the DataLoader) and this package, so that no rank of any attempt
imports them again. The script's own slow imports are ``script.preload``'s, named beside this one
by the node agent. Importing this module does all of it."""

import gc

import torch.distributed.checkpoint
import torch.distributed.checkpoint.state_dict
import torch.distributed.fsdp
import torch.nn.parallel
import torch.utils.data  # noqa: F401

from . import attach, script_main  # noqa: F401

# Everything imported so far moves to the collector's permanent generation: a forked rank's
# garbage collections then never walk (and so never copy) the objects it shares with the forkserver.
gc.freeze()
