"""The ledger's event names, in one place so that writers and readers cannot drift apart."""

SUBMITTING = "submitting"  # `submit` is about to ask the scheduler (a job may start before it answers)
SUBMITTED = "submitted"  # the scheduler answered: the job id
SUBMIT_FAILED = "submit_failed"  # the scheduler refused the submission: nothing runs
STOP_DROPPED = "stop_dropped"  # `submit --resume` dropped a stop request left from before
PREFLIGHT_SKIPPED = "preflight_skipped"
# `submit --resume` / `train --resume`: what the resume changes about the LR schedule or the batch
SCHEDULE_CHANGED = "schedule_changed"
STARTED = "started"  # one per node per attempt
NODE_PREFLIGHT = "node_preflight"
NCCL_PRESET = "nccl_preset"
RESUMED = "resumed"  # trainer rank 0: step it continues from (0 = fresh start)
CHECKPOINT_SAVED = "checkpoint_saved"
CHECKPOINT_INVALID = "checkpoint_invalid"
CHECKPOINT_FAILED = "checkpoint_failed"  # trainer rank 0: a save failed (what, and what was done)
# a background save still writing when a stop saved a newer step: dropped, not waited for
CHECKPOINT_SUPERSEDED = "checkpoint_superseded"
SNAPSHOT_SAVED = "snapshot_saved"  # trainer rank 0: a memory-tier snapshot is complete (step, stall)
SNAPSHOT_INTERVAL = "snapshot_interval"  # trainer rank 0: the memory tier's next snapshot (every_steps: auto)
SNAPSHOT_FAILED = "snapshot_failed"  # trainer, any rank, once an attempt: its snapshots fail; disk serves
CHECKPOINT_WRITER_STARVED = "checkpoint_writer_starved"  # a save restarted at writer_nice (CPU starved)
EXPERIMENT_LOG_FAILED = "experiment_log_failed"  # trainer rank 0: W&B/TensorBoard failed (what was done)
CHECKPOINT_INTERVAL = "checkpoint_interval"  # trainer rank 0: the save interval chosen, and why
STOP_REQUESTED = "stop_requested"
STOP_OVERDUE = "stop_overdue"  # node 0's agent: the stop save overran the kill wait; workers ended
STOPPED = "stopped"  # trainer rank 0: all ranks stopped after `step` and saved
REQUEUED = "requeued"
FINISHED = "finished"
FAILED = "failed"
CANCELLED = "cancelled"
ENDED = "ended"  # node 0's agent: the run stops here by the user's wish (resumable)
HELD = "held"  # an attempt the scheduler started after the run had ended (budget spent): withdrawn
NODE_EXCLUDED = "node_excluded"
NODE_REPLACED = "node_replaced"  # node 0's agent: a hot spare takes a failed node's place in place
REFUSED = "refused"  # an attempt that found another live writer holding the run directory
HANG = "hang"  # node 0's watchdog: a window passed without progress (phase, step, culprit, stacks)
STRAGGLER = "straggler"  # node 0's watchdog: a rank slower than the fastest for several summaries
INITIALIZED = "initialized"  # trainer rank 0: weights taken from another run (train.init_from)
CHAIN_WAITING = "chain_waiting"  # CLI: this run is held until the run it is chained after finishes
CHAIN_RELEASED = "chain_released"  # (both runs) the earlier run finished: the next one released
CHAIN_BLOCKED = "chain_blocked"  # (both runs) the earlier run failed or was cancelled: the next never runs
RESCUE_SUBMITTED = "rescue_submitted"  # a rescue job left behind a job of the run (jobs.rescue)
RESCUE_NOT_SUBMITTED = "rescue_not_submitted"  # the scheduler refused the rescue job: nothing watches
RESCUE = "rescue"  # the rescue job ran: what it found (an undecided attempt, or nothing to do)
RESCUE_CANCELLED = "rescue_cancelled"  # the run ended for good: its waiting rescue jobs withdrawn
AGENT_ERROR = "agent_error"  # an agent left on an error that is not the run's (jobs.agent_exit)

# Events that end a run (until `submit --resume` starts it again).
RUN_ENDS = (FINISHED, FAILED, CANCELLED, ENDED, HELD, SUBMIT_FAILED)
