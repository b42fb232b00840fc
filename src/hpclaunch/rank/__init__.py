"""A rank's run: what every rank of a training run executes around its steps, for the built-in
MMDiT trainer and a user's own script alike (the trainer is this package's first user).

The face is small (``attach``): ``attach(**objects) -> Run``, ``Run.steps(total)``, ``Run.log``,
``Run.phase``, the ``Stopped`` exit. Behind it, module by module:

- where and what: ``site`` (run directory, config, attempt, clock; under hpclaunch or standalone),
  ``session`` (what a rank has before its objects exist: progress, stop handlers), ``dist`` (the
  rank's place among the ranks, JSON collectives);
- the boundary between steps: ``run`` (``Run``), ``stop`` (the stop agreement), ``step_log``
  (``run.log``), ``progress`` (the watchdog's heartbeat; ``fault_injection`` for tests);
- the state: ``objects`` (what a checkpoint holds for the attached objects), ``rng``, ``tensors``,
  ``data_position``, ``restore`` (the one restore rule), ``saving`` and ``periodic_saves`` (disk
  saves and when), ``tiers``, ``checkpoint/`` (the disk tier), ``memory_tier`` + ``snapshots/``
  (the memory tier), ``state_cache``, ``startup`` (start-up's parts for goodput);
- the process: ``host`` (the rank host, one per node: forks the ranks warm), ``forkserver_fork``,
  ``preload``, ``script_main`` (a user's script as a rank), ``ending`` (how a rank's attempt ended),
  ``helper_signals`` (the stop-signal policy of every process beside the ranks).

Imports nothing of ``jobs``, ``orchestrator`` or ``trainer``. This ``__init__`` imports nothing:
``jobs`` imports ``helper_signals`` without torch.
"""
