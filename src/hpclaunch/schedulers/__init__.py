"""Scheduler modules behind one Protocol (``base``): SLURM, PBS, and the embedded local scheduler."""
