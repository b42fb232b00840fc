"""Runs in the JOB's Python as a plain script: a few training steps of one rank, timed.

``hpclaunch preflight`` (torch-free) runs it by path to estimate what a run will take before it is
submitted. Reads ``{"config": {...}, "steps": N}`` on stdin and prints one JSON object as its last
stdout line: the seconds of one optimizer step of one rank (its share of the global batch, gradient
accumulation included; the first step is warm-up and not counted), the device, and how long the
imports and the model build took. One rank on this machine: no gradient all-reduce, no other
ranks' load, and this machine's device, which the caller says. Synthetic data of the model's
shapes; nothing is written. Preflight runs ``measure`` inside its probe (``probe_main.py``), whose
torch import it shares; the script form is for a run without the probe.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: the script imports hpclaunch only once it measures
    from hpclaunch.probe_shapes import StepMeasure, StepRequest  # preflight reads the same shapes

START = time.monotonic()


def measure(request: StepRequest, *, started: float = START) -> StepMeasure:
    """``started``: when this process began (``imports_s`` counts from it)."""
    import torch

    from hpclaunch.config import RunConfig
    from hpclaunch.trainer.model.mmdit_diffusion import build_model
    from hpclaunch.trainer.model.objective import Objective, compute_losses, draw
    from hpclaunch.trainer.setup.build import build_optimizer

    imported = time.monotonic() - started
    cfg = RunConfig.model_validate(request["config"])
    m, t = cfg.model, cfg.train
    device = torch.device("cuda" if cfg.scheduler.gpus_per_node and torch.cuda.is_available() else "cpu")
    if cfg.scheduler.gpus_per_node and device.type != "cuda":
        return {"error": "the run needs GPUs and this machine has none", "device": "cpu"}
    built = time.monotonic()
    model = build_model(m, seed=t.seed).to(device)
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], t, t.lr)
    build_s = time.monotonic() - built
    per_rank, micro = cfg.per_rank_batch, cfg.micro_batch
    gen = torch.Generator().manual_seed(t.seed)
    tokens = torch.randint(0, m.vocab_size, (micro, m.text_len), generator=gen).to(device)
    latents = torch.randn(micro, m.latent_len, m.latent_dim, generator=gen).to(device)
    d = draw(t.seed, 1, list(range(micro)), m.text_len, (m.latent_len, m.latent_dim))
    d = type(d)(*(x.to(device) for x in (d.t_text, d.t_latent, d.mask_keys, d.noise)))
    objective = Objective.of(cfg)
    times = []
    for _ in range(int(request.get("steps", 3)) + 1):  # a request may leave the count out
        t0 = time.perf_counter()
        for _ in range(per_rank // micro):
            losses = compute_losses(model, tokens, latents, d, objective)
            losses.total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "seconds_per_step": sum(times[1:]) / max(1, len(times) - 1),
        "device": str(device),
        "imports_s": imported,
        "build_s": build_s,
        "steps": len(times) - 1,
    }


def main() -> None:
    out: StepMeasure
    try:
        request = json.loads(sys.stdin.read() or "{}")
        out = measure(request)
    except BaseException as e:  # reported, never raised: the caller says it could not measure
        out = {"error": f"{type(e).__name__}: {e}".strip()[:500]}
    sys.stdout.write("\n" + json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
