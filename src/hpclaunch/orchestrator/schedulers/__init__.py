"""orchestrator/schedulers."""
