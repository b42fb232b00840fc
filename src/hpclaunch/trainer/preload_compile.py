"""What the rank host also does once per allocation when the run compiles (``train.compile``), so
that no rank of any attempt does it again: import Dynamo's tracer, AOTAutograd and inductor's
compiler and code caches (~2 s of an in-place restart on this project's machine), hash torch's
sources for the cache keys (``torch_key``, ~0.3 s) and, for CPU ranks, probe the CPU's vector
instruction sets (each probe builds and loads a test library in a subprocess: ~2.5 s). A rank
would otherwise pay all of it at its first step, on every attempt, even when every compiled graph
is in the cache. Imported by name from ``launcher.PRELOAD``, after ``preload``."""

import gc
import os

import torch._dynamo
import torch._functorch.aot_autograd
import torch._inductor.codecache
import torch._inductor.compile_fx

from ..rundir.env import PRELOAD_COMPILE_VAR

torch._inductor.codecache.torch_key()  # cached in this process, so in every rank forked from it
if os.environ.get(PRELOAD_COMPILE_VAR) == "cpu":
    import torch._inductor.cpu_vec_isa

    torch._inductor.cpu_vec_isa.valid_vec_isa_list()

gc.freeze()  # as in preload: what the forkserver shares, out of the ranks' collections
