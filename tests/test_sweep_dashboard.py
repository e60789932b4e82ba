"""`exogym sweep dashboard FOLDER`: optuna-dashboard serves the sweep's study and its loss-vs-bytes view; the page,
the trials and the view's Pareto front (as Optuna computes it, the same as the sweep's frontier) are fetched over
HTTP, and where Debian's chromium is installed the view's page is rendered headless with its Pareto front plot."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from exogym.sweep import grid, sweep
from exogym.sweep.space import config_key
from sweep_runs import tradeoff

pytest.importorskip("optuna")
pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed: pip install 'exogym[sweep]'")
ROOT = Path(__file__).parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, deadline: float) -> bytes:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.spawns
def test_the_dashboard_serves_the_sweeps_study_and_its_loss_vs_bytes_front(tmp_path):
    result = sweep(tradeoff, grid(H=[1, 2, 5], outer_lr=[0.3, 0.5]), out=tmp_path / "s", objective="held_out",
                   extra_metrics=["held_out"], progress=False)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exogym.cli", "sweep", "dashboard", str(tmp_path / "s"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        page = _get(f"http://127.0.0.1:{port}/dashboard", deadline).decode()
        assert "<html" in page.lower()
        studies = json.loads(_get(f"http://127.0.0.1:{port}/api/studies", deadline))["study_summaries"]
        ids = {s["study_name"]: s["study_id"] for s in studies}
        assert sorted(ids) == ["exogym-sweep", "exogym-sweep.pareto"]
        detail = json.loads(_get(f"http://127.0.0.1:{port}/api/studies/{ids['exogym-sweep']}", deadline))
        trials = detail["trials"]
        assert detail["directions"] == ["minimize"]  # the sweep's own study: its one objective
        assert len(trials) == 6 and all(t["state"] == "Complete" for t in trials)
        attrs = {a["key"] for t in trials for a in t["user_attrs"]}
        assert {"payload_bytes_per_node", "run:0"} <= attrs  # bytes and each seed's outcome, beside the loss
        view = json.loads(_get(f"http://127.0.0.1:{port}/api/studies/{ids['exogym-sweep.pareto']}", deadline))
        assert view["directions"] == ["minimize", "minimize"] and len(view["trials"]) == 6  # loss, bytes
        front = {next(a["value"] for a in t["user_attrs"] if a["key"] == "key") for t in view["best_trials"]}
        assert front == {config_key({p: r[p] for p in result.params}) for r in result.frontier()}  # Optuna's = ours
        assert len(front) == 3  # H = 1, 2, 5 at outer lr 0.5: each less loss for more bytes
        chromium = shutil.which("chromium")
        if chromium is not None:  # the view's page as a browser renders it: its Pareto front plot
            dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
                                  "--dump-dom", f"http://127.0.0.1:{port}/dashboard/studies/"
                                  f"{ids['exogym-sweep.pareto']}"],
                                 capture_output=True, text=True, timeout=120).stdout
            assert "exogym-sweep.pareto" in dom and "Pareto Front" in dom, dom[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)
