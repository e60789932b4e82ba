"""`exogym trace` writes a run folder's timeline as Chrome trace events; `exogym ui` refuses what it cannot serve,
and, started, prints an address on 127.0.0.1 whose token every request needs."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

import toy
from exogym import Trainer
from exogym.cli.commands import main
from exogym.runs.loggers import CSVLogger
from exogym.strategy import DiLoCoStrategy, OptimSpec


def _run_folder(root):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification())
    trainer.fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=2), 2, max_steps=4, batch_size=8,
                val_size=16, network="low", logger=CSVLogger(root, "r"), progress=False, device="cpu")
    return trainer.record


def test_trace_writes_the_run_folders_timeline(tmp_path, capsys):
    record = _run_folder(tmp_path)
    assert main(["trace", str(tmp_path / "r"), "-o", str(tmp_path / "t.json")]) == 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == sum(len(lane["kinds"]) for lane in record.timeline["lanes"])
    assert main(["trace", str(tmp_path), "-o", str(tmp_path / "u.json")]) == 2  # not a run folder with a timeline
    assert "has a timeline once it completed" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "r"), "-o", str(tmp_path / "no" / "t.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_ui_refuses_a_root_that_is_not_a_folder(tmp_path, capsys):
    assert main(["ui", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.spawns
def test_ui_prints_a_loopback_address_whose_token_every_request_needs(tmp_path):
    pytest.importorskip("uvicorn")
    _run_folder(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.Popen([sys.executable, "-m", "exogym.cli", "ui", str(tmp_path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line and "?token=" in line, line
        url = line.split(" at ", 1)[1].strip()
        base, token = url.split("/?token=")
        deadline = time.monotonic() + 30
        while True:
            try:
                runs = json.load(urllib.request.urlopen(f"{base}/api/runs?token={token}", timeout=5))
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert [r["name"] for r in runs["runs"]] == ["r"] and runs["runs"][0]["timeline"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/runs", timeout=5)
        assert refused.value.code == 403
    finally:
        proc.terminate()
        proc.wait(10)
