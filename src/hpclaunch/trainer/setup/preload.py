"""What the rank host imports once per allocation before it forks its forkserver
(``forkserver_fork``; a standard forkserver imports it itself), so that no rank of any attempt
imports it again: the trainer, torch's distributed pieces it uses (DCP and its state-dict helpers,
FSDP2, DDP, activation checkpointing, device meshes), mmdit (x_transformers -> einx ->
torch._dynamo: the slowest import of a rank) and TensorBoard's writer. Imported by name from
``rank.host.PRELOAD``; importing this module does all of it."""

import gc

import mmdit.mmdit_generalized_pytorch  # noqa: F401
import torch.distributed.checkpoint
import torch.distributed.checkpoint.state_dict
import torch.distributed.device_mesh
import torch.distributed.fsdp
import torch.nn.parallel  # noqa: F401
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper  # noqa: F401
from torch.utils import tensorboard  # noqa: F401

from .. import entry  # noqa: F401

# Everything imported so far moves to the collector's permanent generation: a forked rank's
# garbage collections then never walk (and so never copy, page by page) the objects it shares with
# the forkserver. Measured: 0.5-0.8 s from fork to the rank's first line without this, ~0.1 s with.
gc.freeze()
