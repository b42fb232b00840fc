"""What the rank host also does once per allocation when the run compiles (``train.compile``), so
that no rank of any attempt does it again: import Dynamo's tracer, AOTAutograd and inductor's
compiler and code caches (~2 s of an in-place restart on this project's machine), hash torch's
sources for the cache keys (``torch_key``, ~0.3 s) and, for CPU ranks, probe the CPU's vector
instruction sets (each probe builds and loads a test library in a subprocess: ~2.5 s), and import
what Dynamo and inductor import only on their first compile or cache load (their backends'
registry, export's passes, inductor's code generators: ~0.15 s). A rank would otherwise pay all of
it at its first step, on every attempt, even when every compiled graph is in the cache. Imported by
name from ``rank.host.PRELOAD``, after ``preload``."""

import contextlib
import gc
import importlib
import os

import torch._dynamo
import torch._functorch.aot_autograd
import torch._inductor.codecache
import torch._inductor.compile_fx

from ...rundir.env import PRELOAD_COMPILE_VAR

# What a first compile imports lazily (listed from ``sys.modules`` before and after a warm first
# step on the CPU; pure Python, none touches a device: the ranks are forked from here, so nothing
# that could start CUDA, triton's code generators included, is imported). A name a later torch
# lacks is skipped.
LAZY = (
    "torch._dynamo.backends.inductor", "torch._dynamo.backends.distributed",
    "torch._dynamo.dce_extra_outputs",
    "torch._dynamo.repro.after_dynamo", "torch._export.db",
    "torch._export.passes.add_runtime_assertions_for_constraints_pass",
    "torch._export.passes.collect_tracepoints_pass", "torch._functorch._aot_autograd.subclass_codegen",
    "torch._higher_order_ops.passes.inline_invoke_subgraph", "torch._inductor.codegen.cpp_wrapper_cpu_array_ref",
    "torch._inductor.codegen.memory_planning", "torch._inductor.codegen.wrapper_fxir",
    "torch._inductor.compiler_bisector", "torch._inductor.hooks", "torch._subclasses.schema_check_mode",
    "torch.distributed.tensor.experimental", "torch.export._trace", "torch.export._unlift",
    "torch.fx.experimental.validator", "torch.utils._cpp_embed_headers",
)  # fmt: skip
for name in LAZY:
    with contextlib.suppress(ImportError):
        importlib.import_module(name)

torch._inductor.codecache.torch_key()  # cached in this process, so in every rank forked from it
if os.environ.get(PRELOAD_COMPILE_VAR) == "cpu":
    import torch._inductor.cpu_vec_isa

    torch._inductor.cpu_vec_isa.valid_vec_isa_list()

gc.freeze()  # as in preload: what the forkserver shares, out of the ranks' collections
