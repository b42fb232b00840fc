"""The allocation side: what runs on the nodes a scheduler gave the run, around the ranks.

One node agent per node (``agent``) stays for the whole allocation. Before every attempt it runs the
node checks and meets the others at the start barrier (``node_checks``); it starts the ranks through
the rank host (``rank_host``, with one signal policy for every helper process: ``helper_signals``),
watches them (``watching``) for hangs (``watchdog``) and slow ranks (``straggler_tracker``), and passes the
scheduler's signals on (``stop_relay``; the ranks' side of the stop protocol is ``stop``). The
agents agree through the run directory (``allocation``: heartbeats, the roster, reports, one
decision); the decider, a role that moves with the roster (``decider_role``), gathers the facts
(``attempt_facts``; ``attribution`` pins a crash on a node), decides what comes next (``decider``;
``decision_rules``, pure) and carries it out through the scheduler (``carry_out``). ``rescue``
decides an attempt the scheduler ended before any agent could; ``chain_end`` releases or cancels
the runs chained after this one.

Imports ``rundir``, ``schedulers`` and ``config``; never the trainer (started by module name) nor
the orchestrator. torch-free.
"""
