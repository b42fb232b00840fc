"""The trainer every rank runs: a joint text + latent MMDiT, trained, stopped and resumed exactly.

On top: the loop (``loop``, started by ``entry``; ``python -m hpclaunch.trainer`` by hand),
validation (``evaluate``), sampling (``sample``), its counters, gradients and state digests, and
the probes preflight runs by path (``probe_main``, ``step_probe``). ``model/``: the MMDiT
(``mmdit_diffusion``), its attention, the objective, the EMA, weights from another run
(``init_from``). ``data/``: the shards' dataset, the loader, each rank's share of a step.
``setup/``: the process group and the wrapped model (``parallel``), compile caches, DDP's buckets,
what the rank host imports once per allocation (``preload``). ``reporting/``: metrics, TensorBoard,
W&B, the attempt's reports, profiles. Saves, restores and stops through ``rank`` (the API a user's
script uses too) and nothing else of the allocation side; never imports the orchestrator.
"""
