"""Sweeps: many runs of one experiment, from a grid of settings (or a search) to the loss-vs-communication frontier.

    from exogym.sweep import sweep, grid
    result = sweep(run_one, grid(H=[10, 30, 100], outer_lr=[0.3, 0.7], seed=[0, 1, 2]), workers=2, out="sweeps/h")
    result.table()                                         # one row per configuration, mean and spread over seeds
    result.frontier("payload_bytes_per_node", "val_loss")  # the Pareto-optimal configurations

`run_one(config, run)` builds a Trainer, calls fit with the configuration's values (config["seed"] included)
and the sweep's settings for the run (`trainer.fit(..., **run.fit_kwargs)`: its folder under out/runs/, its
checkpoints, where it resumes from) and returns trainer.record. A configuration is one set of parameter
values, run with every seed; its results are the mean and spread over the seeds. `exogym sweep` does the same
for the built-in tasks from the command line. docs/sweeps.md tells the whole story.

Modules, one job each: space (grid and search spaces), objective (what is optimised), runs (one run in its run
folder), study (Optuna's study: the bookkeeping), storage (where the study lives, outages), definition (sweep.json),
workers (worker processes), results (table, best, frontier), plots (frontier and heatmap), dashboard
(optuna-dashboard), sweep (the whole of it).
"""

from exogym.sweep.objective import Objective
from exogym.sweep.runs import SweepRun
from exogym.sweep.space import Choice, Float, Int, Space, grid, space
from exogym.sweep.storage import StorageUnavailable, SweepStopped
from exogym.sweep.sweep import SweepResult, load, sweep

__all__ = ["sweep", "load", "grid", "space", "Int", "Float", "Choice", "Space", "Objective", "SweepResult",
           "SweepRun", "StorageUnavailable", "SweepStopped"]
