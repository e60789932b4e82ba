"""Run I/O: what a run measured (record), where it goes (loggers, progress, plots), checkpoints, run folders and
fingerprints."""
