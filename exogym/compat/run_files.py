"""The files and columns the original EXO Gym's CSV logger wrote, next to this library's own.

The original wrote `logs/<run_name>/validation.csv` (step, local_loss, local_perplexity, global_loss,
global_perplexity) and `train.csv` (step, examples_trained, train_loss, train_perplexity, lr); its own
`example/mnist.py` reads validation.csv back to plot and rank the strategies. Here every CSV run folder also holds
validation.csv (the same evaluations as val.csv, in the original's columns), and every train.csv the original's
columns after this library's. Both are table views of the CSV logger (exogym.runs.loggers.TableView): the rows are
this library's, renamed, with perplexity = exp(loss).
"""

from __future__ import annotations

from typing import Mapping

from exogym.runs.loggers import perplexity, register_table_view

__all__ = ["VALIDATION_COLUMNS", "TRAIN_COLUMNS", "validation_file", "train_columns", "perplexity", "install"]

VALIDATION_COLUMNS = ("step", "local_loss", "local_perplexity", "global_loss", "global_perplexity")
TRAIN_COLUMNS = ("step", "examples_trained", "train_loss", "train_perplexity", "lr")


def validation_file(table: str, row: Mapping[str, float]) -> dict[str, dict[str, float | None]]:
    """Each "val" row, as a row of validation.csv in the original's columns (those whose loss was measured)."""
    if table != "val":
        return {}
    out: dict[str, float | None] = dict.fromkeys(VALIDATION_COLUMNS)  # an empty cell where nothing was measured
    out["step"] = row["step"]
    for which in ("local", "global"):
        loss = row.get(f"{which}_loss")
        if loss is not None:
            out.update({f"{which}_loss": loss, f"{which}_perplexity": perplexity(loss)})
    return {"validation": out}


def train_columns(table: str, row: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Each "train" row's original columns (examples_trained, train_loss, train_perplexity), appended to the row;
    step and lr are the same column in both. (Every row of a run has loss and examples; a row logged by hand
    without them gets none.)"""
    if table != "train" or "loss" not in row or "examples" not in row:
        return {}
    return {"train": {"examples_trained": row["examples"], "train_loss": row["loss"],
                      "train_perplexity": perplexity(row["loss"])}}


def install() -> None:
    register_table_view(validation_file)
    register_table_view(train_columns)
