"""A damaged sweep never starts over in silence (issue 46): a study that holds less than the run folders show (its
journal emptied, deleted, cut to no trials, or sweep.json's storage pointed elsewhere) is an error naming both, and
nothing runs; no table shows "completed" without its numbers; a full disk, an SQLite file that cannot be made, a
missing out= and an empty grid each get one sentence naming what to change."""

from __future__ import annotations

import errno
import json
import random
import shutil
import time

import pytest

from exogym.sweep import StorageUnavailable, SweepStopped, grid, load, sweep
from exogym.sweep import report as report_module
from exogym.sweep.results import table_rows
from exogym.sweep.study import Entry
from exogym.sweep.storage import check_url
from sweep_runs import tiny

pytest.importorskip("optuna")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweeps") / "ref"
    sweep(tiny, grid(H=[2, 3], outer_lr=[0.5, 0.7]), out=out, progress=False)
    return out


def _empty(journal):
    journal.write_text("")


def _deleted(journal):
    journal.unlink()


def _no_trials(journal):  # Optuna's journal: op codes below 4 make and describe studies, from 4 on trials
    lines = [line for line in journal.read_text().splitlines() if json.loads(line)["op_code"] < 4]
    journal.write_text("\n".join(lines) + "\n")


def _redirected(journal):
    path = journal.parent / "sweep.json"
    definition = json.loads(path.read_text())
    definition["storage"] = f"sqlite:///{journal.parent / 'elsewhere.db'}"
    path.write_text(json.dumps(definition))


@pytest.mark.parametrize("damage", [_empty, _deleted, _no_trials, _redirected], ids=lambda f: f.__name__[1:])
def test_a_study_holding_less_than_the_run_folders_is_an_error_naming_both(finished, tmp_path, damage):
    out = tmp_path / "s"
    shutil.copytree(finished, out)
    damage(out / "study.journal")
    before = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    with pytest.raises(SweepStopped, match="holds less than the run folders") as info:
        sweep(tiny, grid(H=[2, 3], outer_lr=[0.5, 0.7]), out=out, resume=True, progress=False)
    assert str(out / "runs") in str(info.value) and ("study.journal" in str(info.value) or "elsewhere.db" in
                                                     str(info.value))
    assert {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")} == before  # nothing ran


@pytest.mark.parametrize("newlines", [True, False], ids=["lines", "one-line"])
def test_a_journal_of_random_bytes_never_starts_over(finished, tmp_path, newlines):
    # Optuna skips a last line it cannot read (a write cut short): bytes without a newline read as an empty study.
    out = tmp_path / "s"
    shutil.copytree(finished, out)
    data = random.Random(0).randbytes(500)
    (out / "study.journal").write_bytes(data if newlines else data.replace(b"\n", b""))
    with pytest.raises((StorageUnavailable, SweepStopped), match="damaged|holds less than the run folders"):
        sweep(tiny, grid(H=[2, 3], outer_lr=[0.5, 0.7]), out=out, resume=True, progress=False)


def test_no_table_shows_completed_without_its_numbers(finished, tmp_path):
    # A configuration the study calls completed, whose outcomes neither the study nor the run folders hold.
    rows = table_rows([Entry({"H": 2}, "completed")], ["H"], tmp_path)
    assert rows[0]["status"] == "results lost" and "neither" in rows[0]["error"]
    # A study that lost the runs' outcomes (their journal lines removed), which the run folders still hold: the
    # table reads them from there, numbers and heatmap included (the heatmap once failed on a missing objective).
    out = tmp_path / "s"
    shutil.copytree(finished, out)
    journal = out / "study.journal"
    lines = journal.read_text().splitlines()
    kept = [line for line in lines if not any(k.startswith("run:") for k in json.loads(line).get("user_attr", {}))]
    assert len(kept) < len(lines)
    journal.write_text("\n".join(kept) + "\n")
    result = load(out)
    assert [(r["status"], r["objective"]) for r in result.table()] == \
        [(r["status"], r["objective"]) for r in load(finished).table()]
    assert all(r["objective"] is not None for r in result.table())
    result.write()
    assert (out / "heatmap.png").exists()


def test_a_full_disk_while_writing_the_results_names_the_file(finished, tmp_path, monkeypatch):
    out = tmp_path / "s"
    shutil.copytree(finished, out)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report_module, "plot_frontier", full)
    with pytest.raises(OSError, match=f"cannot write the sweep's plot {out / 'frontier.png'}: the disk is full"):
        load(out).write()


def test_an_sqlite_file_that_cannot_be_created_is_refused_at_once():
    start = time.monotonic()
    with pytest.raises(ValueError, match="the SQLite file /proc/x.db cannot be created"):
        check_url("sqlite:////proc/x.db")
    assert time.monotonic() - start < 5  # not storage_patience's retries


def test_a_missing_out_and_an_empty_grid_are_refused():
    with pytest.raises(TypeError, match="out must be the sweep folder, a path"):
        sweep(tiny, grid(H=[2]), out=None, progress=False)
    for params in ({}, {"seed": [0, 1]}):
        with pytest.raises(ValueError, match=r"grid\(\) needs at least one parameter"):
            grid(**params)
    assert grid(H=30, seed=[0, 1]).count() == 1  # one configuration over seeds: its values fixed
