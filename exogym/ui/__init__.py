"""The web view of a folder of runs (`exogym ui runs/`): the runs list, comparisons, a run's timeline and sweeps.

It reads run folders (exogym.ui.catalog) and serves them with Starlette (exogym.ui.app) on 127.0.0.1 behind a token
(exogym.ui.server); the page draws curves with plotly.js (from the plotly package) and the timeline on a canvas.
Install with `pip install "exogym[ui]"`.
"""

__all__: list[str] = []
