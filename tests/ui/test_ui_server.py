"""The web view's server, in process (Starlette's TestClient): every request needs the token and a served Host, only
GET and HEAD are answered, no name reads outside the root; the runs list reads each status from the folders."""

import json
import os
import socket

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from exogym.runs.marker import MARKER  # noqa: E402
from exogym.ui.app import make_app  # noqa: E402
from exogym.ui.catalog import UnsafePath, resolve_inside  # noqa: E402

TOKEN = "t" * 8 + "0123456789abcdef"


def _marker(folder, status, pid=None, reason=None):
    text = {"run_id": "x", "status": status, "pid": pid if pid is not None else os.getpid(),
            "host": socket.gethostname(), "time": "2026-01-01 00:00:01", "started": "2026-01-01 00:00:00"}
    if reason:
        text["reason"] = reason
    (folder / MARKER).write_text(json.dumps(text))


def make_run(root, name, *, status="completed", steps=3, summary=None, pid=None, strategy="DiLoCoStrategy"):
    """A run folder as a run writes it: config.json, train.csv, val.csv, the marker and (once ended) summary.json."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"strategy": strategy, "num_nodes": 2, "max_steps": 10,
                                                    "strategy_config": {"name": strategy, "H": 5},
                                                    "batch_size": 8, "seed": 0, "run_name": name.split("/")[-1]}))
    rows = "".join(f"{s},{1.0 / s},{s * 8},{s * 100},{s * 0.5}\n" for s in range(1, steps + 1))
    (folder / "train.csv").write_text("step,loss,examples,bytes,sim_time_s\n" + rows)
    (folder / "val.csv").write_text("step,local_loss,global_loss\n0,2.0,2.0\n")
    _marker(folder, "running" if status == "running" else ("failed" if status == "stuck" else status), pid=pid)
    if status != "running":
        (folder / "summary.json").write_text(json.dumps({"status": "failed" if status == "stuck" else status,
                                                         "steps": steps, "final_train_loss": 1.0 / steps,
                                                         "final_global_loss": 2.0, "bytes_per_node": [300, 300],
                                                         "sim_time_s": 1.5, **(summary or {})}))
    return folder


@pytest.fixture
def client(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    make_run(root, "a")
    return TestClient(make_app(root, TOKEN), base_url="http://127.0.0.1:8765")


ROUTES = ["/", "/static/app.js", "/static/plotly.min.js", "/api/runs", "/api/run?name=a", "/api/timeline?name=a",
          "/api/sweep?name=a"]


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_refuses_a_request_without_the_right_token(client, route):
    sep = "&" if "?" in route else "?"
    assert client.get(route).status_code == 403
    assert client.get(f"{route}{sep}token={'x' * len(TOKEN)}").status_code == 403
    assert client.get(route, headers={"X-Exogym-Token": TOKEN[:-1]}).status_code == 403
    assert client.get(f"{route}{sep}token={TOKEN}").status_code != 403  # the boundary: the right one is let in


def test_the_token_may_come_as_a_header_and_the_page_carries_it_to_its_scripts(client):
    page = client.get("/", headers={"X-Exogym-Token": TOKEN})
    assert page.status_code == 200 and f"/static/app.js?token={TOKEN}" in page.text
    assert page.headers["referrer-policy"] == "no-referrer" and "frame-ancestors 'none'" in \
        page.headers["content-security-policy"]


def test_a_foreign_host_and_writing_methods_are_refused(client):
    other = client.get(f"/api/runs?token={TOKEN}", headers={"Host": "evil.example:8765"})
    assert other.status_code == 403 and "evil.example" in other.text
    for method in ("post", "put", "delete", "patch"):
        assert getattr(client, method)(f"/api/runs?token={TOKEN}").status_code == 405
    assert client.get(f"/api/runs?token={TOKEN}", headers={"Host": "localhost:8765"}).status_code == 200


@pytest.mark.parametrize("name", ["..", "../runs", "a/../../etc", "/etc", "//etc", "a//b", "a\\..\\..", "a\x00",
                                  "C:/Windows", ""])
def test_names_leading_outside_the_root_are_refused(client, name):
    for route in ("/api/run", "/api/timeline", "/api/sweep"):
        response = client.get(route, params={"name": name, "token": TOKEN})
        assert response.status_code == 403, (route, name)


def test_a_symbolic_link_out_of_the_root_is_refused_and_not_listed(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    outside = make_run(tmp_path, "secret")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "inside").symlink_to(make_run(root, "real"), target_is_directory=True)  # a link within: fine
    client = TestClient(make_app(root, TOKEN), base_url="http://127.0.0.1")
    assert client.get("/api/run", params={"name": "link", "token": TOKEN}).status_code == 403
    assert client.get("/api/run", params={"name": "inside", "token": TOKEN}).status_code == 200
    listed = {r["name"] for r in client.get("/api/runs", params={"token": TOKEN}).json()["runs"]}
    assert listed == {"real"}  # links are not followed while listing
    with pytest.raises(UnsafePath, match="outside the served root"):
        resolve_inside(root.resolve(), "link")


def test_the_token_and_root_are_checked(tmp_path):
    with pytest.raises(ValueError, match="at least 16 letters"):
        make_app(tmp_path, "short")
    with pytest.raises(ValueError, match="at least 16 letters"):
        make_app(tmp_path, "a" * 16 + "<script>")
    with pytest.raises(ValueError, match="is not a folder"):
        make_app(tmp_path / "missing", TOKEN)


def test_runs_list_reads_every_status(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "done")
    make_run(root, "live", status="running", steps=4)
    make_run(root, "killed", status="running", pid=2**22 + 12345)  # its process is gone: it ended unrecorded
    make_run(root, "broke", status="failed", summary={"error": "ValueError: nan at step 3"})
    make_run(root, "stopped", status="interrupted", summary={"signal": "SIGTERM", "resume_from": "ck/step_2"})
    make_run(root, "hung", status="stuck", summary={"stuck": True, "error": "NodeTimeoutError: node 1"})
    make_run(root, "sweeps/s1/runs/H=5,seed=0")
    (root / "sweeps" / "s1" / "sweep.json").write_text("{}")
    (root / "sweeps" / "s1" / "results.csv").write_text("H,objective,payload_bytes_per_node\n5,0.5,100\n")
    client = TestClient(make_app(root, TOKEN), base_url="http://127.0.0.1")
    data = client.get("/api/runs", params={"token": TOKEN}).json()
    runs = {r["name"]: r for r in data["runs"]}
    assert {n: r["status"] for n, r in runs.items()} == {
        "done": "completed", "live": "running", "killed": "interrupted", "broke": "failed", "stopped": "interrupted",
        "hung": "stuck", "sweeps/s1/runs/H=5,seed=0": "completed"}
    assert runs["broke"]["error"] == "ValueError: nan at step 3" and "ck/step_2" in runs["stopped"]["error"]
    assert runs["live"]["steps"] == 4 and runs["live"]["train_loss"] == 0.25  # from its rows, as it trains
    assert runs["done"]["bytes_per_node"] == 300 and runs["sweeps/s1/runs/H=5,seed=0"]["sweep"] == "sweeps/s1"
    assert data["sweeps"] == ["sweeps/s1"]
    sweep = client.get("/api/sweep", params={"name": "sweeps/s1", "token": TOKEN}).json()
    assert sweep["rows"] == [{"H": "5", "objective": "0.5", "payload_bytes_per_node": "100"}]
    assert "exogym sweep dashboard runs/sweeps/s1" in sweep["commands"]


def test_a_run_gives_its_rows_from_where_the_reader_is_and_its_rerun_call(client):
    whole = client.get("/api/run", params={"name": "a", "token": TOKEN}).json()
    assert whole["train"]["step"] == [1, 2, 3] and whole["val"]["global_loss"] == [2.0]
    rest = client.get("/api/run", params={"name": "a", "since": 2, "since_val": 1, "token": TOKEN}).json()
    assert rest["train"]["step"] == [3] and rest["val"]["global_loss"] == []
    assert "DiLoCoStrategy(H=5)" in whole["rerun"] and "CSVLogger('runs', run_name='a')" in whole["rerun"]
    assert client.get("/api/run", params={"name": "a", "since": "x", "token": TOKEN}).status_code == 400
    missing = client.get("/api/timeline", params={"name": "a", "token": TOKEN})
    assert missing.status_code == 404 and "network=" in missing.json()["error"]


def test_the_rerun_call_reruns_the_run_exactly(tmp_path):
    """The call shown for a run, run as shown (with the run's model and data), gives the run's rows again."""
    import torch

    import toy
    from exogym import Trainer
    from exogym.runs.loggers import CSVLogger
    from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
    from exogym.ui.catalog import read_json, run_rows
    from exogym.ui.reproduce import rerun_call

    data = toy.make_classification(), toy.make_classification(64, seed=1)
    trainer = Trainer(toy.TinyMLP(), *data)
    trainer.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=0.01), H=3, outer_lr=0.5), 3, max_steps=9,
                batch_size=8, val_size=16, val_interval=3, seed=7, network="low", node_speeds=[1, 0.5, 0.5],
                device_flops=1e9, logger=CSVLogger(tmp_path / "first", "r"), progress=False, device="cpu")
    call = rerun_call(read_json(tmp_path / "first" / "r" / "config.json"), {}, str(tmp_path / "again"))
    exec(call, {"model": toy.TinyMLP(), "train_dataset": data[0], "val_dataset": data[1]})
    first, again = (run_rows(tmp_path / d / "r", "train") for d in ("first", "again"))
    assert again["loss"] == first["loss"] and again["sim_time_s"] == first["sim_time_s"]
