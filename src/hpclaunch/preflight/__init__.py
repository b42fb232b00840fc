"""Preflight: checks that say in seconds whether a run can work, on the login node and on every node.

- ``run_login_checks(cfg, only=...)``: env, gpu, data, disk, network, scheduler, config
  (``hpclaunch preflight``; ``hpclaunch submit`` refuses to submit on a failure).
- ``run_node_checks(cfg, node_ctx)``: node, env, gpu, data, disk, network, run by the node agent
  before the ranks start (a failing node ends the attempt; a spare takes its place, or without one the run
  continues on other nodes).
- ``smoke.run_distributed_smoke``: all_reduce + barrier across all ranks, in the trainer.

Nothing here imports torch: what torch knows comes from a probe subprocess in the job's Python.
"""

from __future__ import annotations

from .results import CheckResult, Report, Status, print_report
from .runner import CHECKS, LOGIN_CHECKS, NODE_CHECKS, HostView, run_login_checks, run_node_checks

__all__ = [
    "CHECKS",
    "LOGIN_CHECKS",
    "NODE_CHECKS",
    "CheckResult",
    "HostView",
    "Report",
    "Status",
    "print_report",
    "run_login_checks",
    "run_node_checks",
]
