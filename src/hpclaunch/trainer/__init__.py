"""The trainer every rank runs: a joint text + latent MMDiT, trained, stopped and resumed exactly.

Owns the model (``model``) and the objective (``objective``), the data it reads (``data``,
``loader``), the loop (``loop``, started by ``entry``; set-up in ``build``, ``dist``), the periodic
saves and checkpoints (``periodic_saves``, ``checkpoint/``), EMA, validation and sampling (``ema``,
``evaluate``, ``sample``), what it reports (``metrics_window``, ``rank_progress``, ``startup``, ``explog`` with
``tensorboard`` and ``wandb_log``), starting from another run's weights (``init_from``,
``init_source``), the rank host that forks the ranks (``launcher``, ``preload``) and the probes
preflight runs by path (``probe_main``, ``step_probe``, ``smoke``). Stops through the stop protocol
of ``rank.stop`` and nothing else of the allocation side; never imports the orchestrator.
"""
