"""A sweep's results as a user holds them: the table, the best configuration, the frontier, the command that
reruns a configuration, and the files written into the sweep folder (results.csv, results.md, the plots)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from exogym.sweep.plots import plot_frontier, plot_heatmap
from exogym.sweep.results import best_row, markdown, pareto, table_rows, write_csv
from exogym.sweep.storage import writing

__all__ = ["SweepResult"]


class SweepResult:
    """A sweep's results, read from its study: table(), best(), frontier(x, y), write()."""

    def __init__(self, definition: Any, study: Any):  # a sweep.Definition and its study.SweepStudy
        self.definition, self.study = definition, study
        self.folder = Path(definition.folder)
        self.objective, self.space = definition.objective, definition.space
        self.params = definition.space.names

    def table(self) -> list[dict[str, Any]]:
        """One row per configuration: parameters, status, seeds completed, and for the objective and every
        metric its mean over the seeds (and `<name>_std`, the sample standard deviation)."""
        return table_rows(self.study.entries(), self.params, self.folder)

    def best(self) -> dict[str, Any] | None:
        """The completed, feasible row with the best mean objective."""
        return best_row(self.table(), self.objective)

    def frontier(self, x: str = "payload_bytes_per_node", y: str = "objective") -> list[dict[str, Any]]:
        """The Pareto-optimal completed rows: no other row has both a smaller x and a better y; sorted by x.
        y is maximised when it is the objective of a maximising sweep."""
        rows = [r for r in self.table() if r["status"] == "completed"]
        maximize = self.objective.direction == "maximize" and y in ("objective", self.objective.metric,
                                                                       self.objective.name)
        return pareto(rows, x, y, maximize_y=maximize)

    def rerun_command(self, row: dict[str, Any]) -> str:
        """The command (a CLI sweep) or call that runs this configuration again, every seed."""
        seeds = " ".join(map(str, self.space.seeds))
        if self.definition.command is not None:
            parts = list(self.definition.command)
            for p in self.params:
                if row.get(p) is not None:
                    parts += [self.definition.flags.get(p, f"--{p}"), str(row[p])]
            return " ".join(parts + ["--seeds", seeds, "--out", f"{os.path.relpath(self.folder)}-rerun"])
        config = ", ".join(f"{p!r}: {row[p]!r}" for p in self.params if row.get(p) is not None)
        name = "run" if self.definition.run_repr else self.definition.run.split(":")[-1]
        return f"{name}({{{config}, 'seed': S}}) for S in [{seeds.replace(' ', ', ')}]"

    def write(self, *, announce: bool = False) -> list[Path]:
        """results.csv, results.md, frontier.png and heatmap.png (when matplotlib is there) in the sweep folder."""
        rows = self.table()
        with writing(self.folder / "results.csv", "the sweep's table"):
            written = [write_csv(rows, self.params, self.folder / "results.csv")]
        text = markdown(rows, self.params, self.objective)
        with writing(self.folder / "results.md", "the sweep's table"):
            (self.folder / "results.md").write_text(text + "\n")
        written.append(self.folder / "results.md")
        try:
            heatmap = self.definition.search == "grid"  # a search's values do not fall on a grid
            with writing(self.folder / "frontier.png", "the sweep's plot"):
                written.append(plot_frontier(rows, self.params, self.objective, self.folder / "frontier.png"))
            if heatmap:
                with writing(self.folder / "heatmap.png", "the sweep's plot"):
                    written.append(plot_heatmap(rows, self.params, self.objective, self.folder / "heatmap.png"))
            written = [p for p in written if p is not None]
        except ImportError as e:
            if announce:
                print(f"exogym sweep: no plots ({e})")
        if announce:
            self._announce(rows, text, written)
        return written

    def _announce(self, rows: list[dict[str, Any]], text: str, written: list[Path]) -> None:
        print("\n" + text)
        counts = {s: sum(r["status"] == s for r in rows) for s in dict.fromkeys(r["status"] for r in rows)}
        print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if counts.get("interrupted") or counts.get("waiting"):
            print(f"not finished: resume with resume=True (exogym sweep --resume {self.folder})")
        best = best_row(rows, self.objective)
        if best is not None:
            config = ", ".join(f"{p}={best[p]}" for p in self.params if best.get(p) is not None)
            spread = f" ± {best['objective_std']:.4f}" if best["objective_std"] is not None else ""
            print(f"best: {config or 'the one configuration'}: {self.objective.metric} {best['objective']:.4f}{spread} over {best['seeds']} "
                  f"seed(s)\nrerun it: {self.rerun_command(best)}")
        print("written: " + ", ".join(str(p) for p in written), flush=True)
