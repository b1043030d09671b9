"""A training run's folder as a format: its checkpoints (checkpoint.py, the one owner of step-N/)
and the other names train writes there (folder.py). train writes them; eval, export and status
read them without importing train."""
