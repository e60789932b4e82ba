"""Trainer.fit, from the arguments to the record: the configuration with every check that needs only the
arguments (config.py), the plan built from it, the model, the data and the machine (plan.py; nodes.py: every node's
data and memory; resume.py: where a run starts; loggers.py: the loggers and their run folders), and the lifecycle of
one run (lifecycle.py; run_end.py: how it ended). trainer.py holds Trainer, which `exogym` exports."""
