"""Nothing lost across processes and machines (issue 38): a resumed run writes the rows its folder misses up to the
checkpoint, exogym's errors keep their type across processes (with the node or rank named), the record's peak
memory covers every process, and under torchrun a checkpoint folder each machine sees on its own disk is refused
before any node starts. (Rows as they are flushed, lost and stopped processes: tests/test_faults_injection.py.)"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fault_run
from exogym import DiskFullError, Trainer
from exogym.strategy import DiLoCoStrategy
from exogym.strategy.optim import OptimSpec
from faulty import FailOnNode
from toy import TinyMLP

TESTS = Path(__file__).resolve().parent


def steps_in(run: Path) -> list[int]:
    with open(run / "train.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def test_exogyms_errors_keep_their_type_across_processes_with_the_node_named():
    trainer = Trainer(TinyMLP(), FailOnNode(rank=1, index=16 * 4, fail="diskfull"))
    with pytest.raises(DiskFullError, match="no space left") as info:
        trainer.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.1), H=3), 2, max_steps=10, batch_size=16,
                    shuffle=False, progress=False, logger=False, processes=2)
    assert any("node 1" in note for note in info.value.__notes__)


def test_peak_memory_covers_every_process_and_each_one():
    trainer = Trainer(TinyMLP(), FailOnNode(rank=1, index=-1))
    trainer.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.1), H=3), 2, max_steps=3, batch_size=16,
                progress=False, logger=False, processes=2)
    peak = trainer.record.peak_memory_mb
    assert len(peak["per_process_rss"]) == 2 and all(p > 10 for p in peak["per_process_rss"])
    assert peak["run_rss"] == pytest.approx(sum(peak["per_process_rss"]) + peak["process_rss"])


_TWO_DISKS = """
import os, sys
sys.path.insert(0, {tests!r})
os.makedirs("machine" + os.environ["RANK"], exist_ok=True)
os.chdir("machine" + os.environ["RANK"])  # each rank its own working folder: two machines, each with its own disk
import fault_run, torch
torch.set_num_threads(1)
fault_run.fit()
"""


def test_under_torchrun_a_checkpoint_folder_not_every_rank_sees_is_refused_before_training(tmp_path):
    script = tmp_path / "two_disks.py"
    script.write_text(_TWO_DISKS.format(tests=str(TESTS)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode != 0
    assert "checkpoints need one folder every rank sees, and rank(s) [1] do not see" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "machine0" / "logs" / "r" / "train.csv").exists()  # no node started
    assert not list((tmp_path / "machine1").rglob("node_*"))


def test_under_torchrun_the_torch_backend_names_the_rank_that_went_away_not_its_own_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(fault_run.command("SIGKILL", 6, "torchrun-torch"), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=150)
    assert out.returncode != 0
    summary = json.loads((tmp_path / "logs" / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["lost_peer"] == {"process": 1, "nodes": [1]}, summary
    assert summary["error"].startswith("PeerLostError: process 1 (node 1) went away"), summary["error"]


def test_a_caller_killed_at_a_checkpoint_resumes_writing_the_rows_its_folder_misses(tmp_path):
    # Node 1 SIGKILLs the caller as it reads step 13's batch: checkpoint 12 is written, and its rows were just sent
    # to the caller, which may die before writing them (issue 38 saw train.csv at 150 with checkpoint 160 in 3 of
    # 4 tries). The processes end with their caller. train.csv is then cut back to step 9, as such a kill can leave
    # it: the resume writes steps 10-12 from what the checkpoint carries, and the run holds every step once.
    run = tmp_path / "logs" / "r"
    killed = subprocess.run(fault_run.command("caller-SIGKILL", 13, "processes"), cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-3000:]
    lines = (run / "train.csv").read_text().splitlines(keepends=True)
    (run / "train.csv").write_text("".join(lines[:10]))
    assert steps_in(run) == list(range(1, 10))
    resumed = subprocess.run(fault_run.command("resume", 0, "processes"), cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps_in(run) == list(range(1, fault_run.MAX_STEPS + 1))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == fault_run.MAX_STEPS
