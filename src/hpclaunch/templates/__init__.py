"""Job scripts: the templates (SLURM, PBS and the local scheduler's, side by side) and their checks.

Owns the Jinja2 environment every script renders with (``jinja``: StrictUndefined, every value
quoted for the shell by ``finalize``), the one function that quotes a value for a shell (``shell``)
and the lint every rendered script passes before it is shown or submitted (``lint``). What a
template says comes from the JobPlan (``rundir.plan``); the scheduler modules fill the templates.
"""
