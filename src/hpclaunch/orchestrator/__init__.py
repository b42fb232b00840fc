"""The login side: from a config to a submitted job, and a run's story told from its directory.

Owns planning (``plan_build``: config -> JobPlan, pure), the login flow (``launch``: plan, script,
preflight, run directory, submit; ``chain_submit``: ``submit --after``), what ``status`` shows (``status``,
``lineage``, ``stragglers``, ``checkpoint_interval``), where the wall-clock time went and the
goodput (``time_inputs`` reads, ``accounting`` adds up), the ETA and cost (``cost``) and the report
(``report``, ``figures``). Reads run directories through ``rundir`` and reaches schedulers through
their Protocol; never imports the allocation side (``jobs``) or the trainer, and never torch.
"""
