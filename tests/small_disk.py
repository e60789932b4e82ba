"""A small filesystem for the full-disk tests: a tmpfs of a few hundred KB mounted in a private mount namespace.

`run_on_small_disk(folder, size_kb)` runs this file as a script in `unshare -rm` (root in a user namespace, so no
real privilege is needed where user namespaces are allowed) with a tmpfs mounted on `folder`; the script runs every
scenario below on it, each leaving a chosen amount of free space, and prints what it saw as one JSON object: the
mount goes away with the process, so the test asserts on that report. `small_disk_unavailable()` says why the
machine cannot do this (the tests then skip with that reason).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import toy


def small_disk_unavailable() -> str | None:
    """None where a tmpfs can be mounted in a private namespace here; otherwise why not."""
    if not sys.platform.startswith("linux"):
        return f"a tmpfs in a private mount namespace needs Linux, this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the unshare command (util-linux) is not installed"
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{folder}'"],
                             capture_output=True, text=True)
    if out.returncode != 0:
        return f"cannot mount a tmpfs in a user namespace here ({out.stderr.strip() or out.returncode})"
    return None


def run_on_small_disk(folder: Path, size_kb: int) -> tuple[dict, str]:
    """Run every scenario on a `size_kb` tmpfs mounted on `folder`; (the report, the script's stderr)."""
    folder.mkdir(parents=True, exist_ok=True)
    command = f"mount -t tmpfs -o size={size_kb}k tmpfs '{folder}' && exec '{sys.executable}' '{__file__}' '{folder}'"
    out = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=240)
    if out.returncode != 0 or not out.stdout.strip():
        raise AssertionError(f"the small-disk script failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


# ---- inside the namespace -------------------------------------------------------------------------------------

def _leave_free(disk: Path, free: int) -> Path:
    """Fill the disk with a file so that about `free` bytes stay free (tmpfs counts whole 4 KB pages)."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    extra = shutil.disk_usage(disk).free - free
    if extra > 0:
        filler.write_bytes(b"\1" * extra)
    return filler


def _csv_report(path: Path) -> dict:
    if not path.exists():
        return {"exists": False}
    text = path.read_text()
    lines = text.splitlines()
    return {"exists": True, "ends_with_newline": text.endswith("\n"), "rows": len(lines) - 1,
            "fields": sorted({line.count(",") for line in lines})}


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None),
            "filename": getattr(e, "filename", None), "needed": getattr(e, "needed", None),
            "free": getattr(e, "free", None)}


class LargeState(toy.TinyMLP):
    """TinyMLP with a 300 KB buffer: a large state to checkpoint; counts its forward passes."""

    forwards = 0

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.zeros(300, 256))

    def forward(self, batch):
        type(self).forwards += 1
        return super().forward(batch)


class ManyMetrics(toy.TinyMLP):
    """TinyMLP whose rows are wide (60 metrics): a log disk fills in few steps."""

    def forward(self, batch):
        out = super().forward(batch)
        return {**out, **{f"metric_with_a_long_name_{i:02d}": out["loss"].detach() * i for i in range(60)}}


def _scenarios(disk: Path) -> dict:
    from exogym import Trainer
    from exogym.runs.checkpoint import (CheckpointPlan, NodeState, find_checkpoint, load_checkpoint, read_manifest,
                                        save_node_state, check_checkpoint_space)
    from exogym.runs.disk import AppendFile, DiskFullError
    from exogym.runs.folder import MARKER, check_writable, claim_run
    from exogym.comm.transport import CommStats
    from exogym.cluster.simtime import NodeClock
    from exogym.runs.record import NodeLog
    from exogym.strategy import OptimSpec, SimpleReduceStrategy

    os.chdir(disk)
    report: dict = {}
    fit = dict(batch_size=8, progress=False, device="cpu")

    def trainer(hidden=16):
        return Trainer(toy.TinyMLP(hidden=hidden), toy.make_classification(160))

    def strategy():
        return SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2))

    # 1. Too little space at the start: refused before a folder is made, and the name stays free.
    _leave_free(disk, 16 * 1024)
    try:
        check_writable(disk / "logs", "the log folder")
        report["probe"] = None
    except DiskFullError as e:
        report["probe"] = _error(e)
    try:
        trainer().fit(strategy(), 2, max_steps=2, run_name="tiny", **fit)
        report["tiny_fit"] = None
    except Exception as e:  # noqa: BLE001 - reported
        report["tiny_fit"] = _error(e)
    report["tiny_left"] = sorted(p.name for p in (disk / "logs").rglob("*")) if (disk / "logs").exists() else []

    # 2. config.json that does not fit: CSVLogger.start fails, leaving nothing that blocks the name.
    _leave_free(disk, 100 * 1024)
    try:
        trainer().fit(strategy(), 2, max_steps=2, run_name="big", extra_config={"blob": "x" * 200_000}, **fit)
        report["big_fit"] = None
    except Exception as e:  # noqa: BLE001
        report["big_fit"] = _error(e)
    report["big_left"] = (disk / "logs" / "big").exists()
    (disk / "filler").unlink()
    trainer().fit(strategy(), 2, max_steps=2, run_name="tiny", **fit)
    trainer().fit(strategy(), 2, max_steps=2, run_name="big", **fit)
    report["names_free"] = [_csv_report(disk / "logs" / n / "train.csv")["rows"] for n in ("tiny", "big")]
    shutil.rmtree(disk / "logs")

    # 3. A disk that fills up with checkpoints: the run fails naming the file; the newest complete one loads.
    _leave_free(disk, 300 * 1024)
    try:
        trainer(hidden=256).fit(strategy(), 2, max_steps=30, checkpoint_interval=2, keep_checkpoints=100,
                                checkpoint_dir="ck", run_name="ckrun", **fit)
        report["ck_fit"] = None
    except Exception as e:  # noqa: BLE001
        report["ck_fit"] = _error(e)
    report["ck_listing"] = sorted(p.name for p in (disk / "ck").iterdir())
    newest = find_checkpoint(disk / "ck")
    manifest = read_manifest(newest)
    states = load_checkpoint(newest, manifest, devices=[torch.device("cpu")] * 2)
    report["ck_loaded_step"] = [s.step for s in states]
    report["ck_train_csv"] = _csv_report(disk / "logs" / "ckrun" / "train.csv")
    report["ck_marker"] = json.loads((disk / "logs" / "ckrun" / MARKER).read_text())
    summary = disk / "logs" / "ckrun" / "summary.json"
    report["ck_summary"] = json.loads(summary.read_text()) if summary.exists() else None
    shutil.rmtree(disk / "ck"), shutil.rmtree(disk / "logs")

    # 4. torch.save's own failure (its file is larger than the tensors' bytes that the check before it counts).
    _leave_free(disk, 8 * 1024)
    plan = CheckpointPlan(disk / "raw", 1, 1, {"num_nodes": 1}, "r1", {})
    many = {f"t{i}": torch.zeros(1) for i in range(300)}  # 1.2 KB of tensors, ~60 KB of zip entries
    state = NodeState(1, many, {}, {}, CommStats(), NodeLog(0), NodeClock())
    try:
        save_node_state(plan, 0, state)
        report["raw_save"] = None
    except Exception as e:  # noqa: BLE001
        report["raw_save"] = _error(e)
    report["raw_left"] = sorted(p.name for p in (disk / "raw").iterdir())

    # 5. Not enough space for one checkpoint, known before training.
    _leave_free(disk, 200 * 1024)
    try:
        check_checkpoint_space(disk / "ck2", torch.nn.Linear(300, 256), 2)  # 2 x 301 KB
        report["space"] = None
    except DiskFullError as e:
        report["space"] = _error(e)
    check_checkpoint_space(disk / "ck2", torch.nn.Linear(30, 25), 2)  # 2 x 3 KB: fits
    try:
        Trainer(LargeState(), toy.make_classification(160)).fit(strategy(), 2, max_steps=2, checkpoint_interval=1,
                                                                checkpoint_dir="ck2", logger=False, **fit)
        report["space_fit"] = None
    except Exception as e:  # noqa: BLE001
        report["space_fit"] = _error(e)
    report["space_fit_forwards"] = LargeState.forwards
    report["space_left"] = (disk / "ck2").exists()

    # 6. Rows on a full log disk: the table ends on a whole row, the marker says failed, finish does not raise.
    _leave_free(disk, 72 * 1024)
    try:
        Trainer(ManyMetrics(), toy.make_classification(160)).fit(strategy(), 2, max_steps=400, run_name="rows",
                                                                   **fit)
        report["rows_fit"] = None
    except Exception as e:  # noqa: BLE001
        report["rows_fit"] = _error(e)
    report["rows_csv"] = _csv_report(disk / "logs" / "rows" / "train.csv")
    report["rows_marker"] = json.loads((disk / "logs" / "rows" / MARKER).read_text())

    # 7. A row appended on a full disk is cut back; a claim's release needs no new block.
    shutil.rmtree(disk / "logs")
    claim = claim_run([disk / "logs"], "rel", "unused")
    table = AppendFile(disk / "logs" / "rel" / "t.csv", "the t table", fresh=True)
    table.append("a,b\r\n")
    _leave_free(disk, 0)
    try:
        table.append("1," + "2" * 20_000 + "\r\n")
        report["append"] = None
    except DiskFullError as e:
        report["append"] = _error(e)
    table.close()
    report["append_left"] = (disk / "logs" / "rel" / "t.csv").read_text()
    report["free_at_release"] = shutil.disk_usage(disk).free
    claim.release("failed", reason="disk full: a test")
    report["released"] = json.loads((disk / "logs" / "rel" / MARKER).read_text())
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(_scenarios(Path(sys.argv[1]))))
