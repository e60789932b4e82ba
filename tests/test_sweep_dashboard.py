"""`exogym sweep dashboard FOLDER`: optuna-dashboard serves the sweep's study; the page and the study's trials are
fetched over HTTP (and, where Debian's chromium is installed, rendered headless)."""

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
from sweep_runs import tiny

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


def test_the_dashboard_serves_the_sweeps_study(tmp_path):
    sweep(tiny, grid(H=[2, 5]), out=tmp_path / "s", progress=False)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exogym.cli", "sweep", "dashboard", str(tmp_path / "s"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        page = _get(f"http://127.0.0.1:{port}/dashboard", deadline).decode()
        assert "<html" in page.lower()
        studies = json.loads(_get(f"http://127.0.0.1:{port}/api/studies", deadline))["study_summaries"]
        assert [s["study_name"] for s in studies] == ["exogym-sweep"]
        detail = json.loads(_get(f"http://127.0.0.1:{port}/api/studies/{studies[0]['study_id']}", deadline))
        trials = detail["trials"]
        assert sorted(t["params"][0]["param_external_value"] for t in trials) == ["2", "5"]
        assert all(t["state"] == "Complete" for t in trials)
        attrs = {a["key"] for t in trials for a in t["user_attrs"]}
        assert {"payload_bytes_per_node", "run:0"} <= attrs  # bytes and each seed's outcome, beside the loss
        chromium = shutil.which("chromium")
        if chromium is not None:  # the page as a browser renders it
            dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000",
                                  "--dump-dom", f"http://127.0.0.1:{port}/dashboard/studies/"
                                  f"{studies[0]['study_id']}/trials"],
                                 capture_output=True, text=True, timeout=120).stdout
            assert "exogym-sweep" in dom and "Complete" in dom
    finally:
        proc.terminate()
        proc.wait(30)
