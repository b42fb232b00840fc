"""hpclaunch: one YAML file to a SLURM/PBS MMDiT training run that survives time limits and preemption."""

__version__ = "0.1.0"
