"""Names of the variables hpclaunch's own launchers set in a job (local controller, PBS script,
node agent) and the trainer reads. Scheduler variables (``SLURM_*``, ``PBS_*``) are read only by
their scheduler module in ``hpclaunch.schedulers``."""

RUN_DIR_VAR = "HPCLAUNCH_RUN_DIR"
JOB_ID_VAR = "HPCLAUNCH_JOB_ID"
RESTART_VAR = "HPCLAUNCH_RESTART_COUNT"
START_TIME_VAR = "HPCLAUNCH_JOB_START_TIME"  # epoch seconds at which the allocation started
# The attempt's whole clock (rundir.clock.AttemptClock as JSON), set by the node agent for the ranks.
CLOCK_VAR = "HPCLAUNCH_ATTEMPT_CLOCK"
NODE_RANK_VAR = "HPCLAUNCH_NODE_RANK"
ATTEMPT_VAR = "HPCLAUNCH_ATTEMPT"
JOIN_STDERR_VAR = "HPCLAUNCH_JOIN_STDERR"  # set by the node agent: ranks write stderr into stdout
NODE_NAME_VAR = "HPCLAUNCH_NODE_NAME"  # set by the node agent: this node, as the scheduler names it
PRELOAD_COMPILE_VAR = "HPCLAUNCH_PRELOAD_COMPILE"  # set by the node agent for train.compile runs
ALLOCATION_VAR = "HPCLAUNCH_ALLOCATION"  # set by the node agent: job id + the scheduler's restart count
FOREGROUND_VAR = "HPCLAUNCH_FOREGROUND"  # set by `hpclaunch train`: the agent runs in its process
# Set by the node agent: the node-local folder its ranks write their progress to (``rundir.progress_files``).
PROGRESS_DIR_VAR = "HPCLAUNCH_PROGRESS_DIR"
# Set by the node agent for its rank host: the modules (comma-separated) it imports once before it
# forks the ranks (``rank.host``); unset: the built-in trainer's.
PRELOAD_VAR = "HPCLAUNCH_PRELOAD"
# Set by the node agent: this user's node-local directory as the ranks see it (``rundir.node_dir``),
# and the token its rank host proves it with.
NODE_DIR_VAR = "HPCLAUNCH_NODE_DIR"
NODE_DIR_TOKEN_VAR = "HPCLAUNCH_NODE_DIR_TOKEN"
