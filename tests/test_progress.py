"""The progress bar shows the record's numbers: the same merged rows, the same definitions."""

import re

import toy
from exogym import Trainer
from exogym.runs.progress import RunProgress
from exogym.strategy import DiLoCoStrategy


def test_the_bar_gets_the_records_rows_and_a_line_closes_the_run(monkeypatch, capsys):
    shown, validations = [], []
    monkeypatch.setattr(RunProgress, "train_row", lambda self, row: (shown.append(dict(row)), self.bar.update(1)))
    original_val_row = RunProgress.val_row
    monkeypatch.setattr(RunProgress, "val_row",
                        lambda self, row: (validations.append(row), original_val_row(self, row)))
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
    # Node 2 is down for steps 3-5: the loss is the mean over the nodes up, bytes are per node.
    t.fit(DiLoCoStrategy(lr=0.01, H=2), 3, batch_size=8, max_steps=8, val_interval=4, log_interval=3,
          failures=[(2, 3, 6)], device="cpu", logger=False)
    assert shown == t.record.train
    assert validations == t.record.val and validations[0]["step"] == 0
    up = [[loss for loss in (node[s] for node in t.record.node_loss) if loss == loss] for s in range(8)]
    assert [row["loss"] for row in shown] == [sum(ls) / len(ls) for ls in up]
    assert [row["bytes"] for row in shown][-1] == sum(t.record.bytes_per_node) / 3
    captured = capsys.readouterr()
    done = [line for line in captured.out.splitlines() if line.startswith("exogym: done:")]
    assert len(done) == 1 and "8 steps" in done[0]
    assert re.search(rf"val loss {t.record.val[-1]['global_loss']:.4f}", done[0])
    assert "exogym:" in captured.err and "8/8" in captured.err  # the bar, on stderr


def test_the_time_left_is_shown_only_once_the_steps_after_the_first_measure_it():
    # A first step of 10 s (imports, optimizers, a loaded machine), then 0.125 s a step: tqdm's own estimate after
    # step 1 said 199 x 10 s (33 minutes); no estimate is shown until 3 steps after the first took 1 s or more,
    # and then it is the pace of those steps.
    now = [0.0]
    bar = RunProgress(200, clock=lambda: now[0])
    try:
        row = {"loss": 1.0, "bytes": 0.0}
        now[0] += 10.0
        bar.train_row(row)
        assert bar.seconds_left() is None and "<" not in str(bar.bar) and "left" not in str(bar.bar)
        for _ in range(7):  # 0.875 s after the first: not yet
            now[0] += 0.125
            bar.train_row(row)
            assert bar.seconds_left() is None, bar.steps
        now[0] += 0.125
        bar.train_row(row)  # 8 steps after the first, in 1 s
        assert bar.seconds_left() == 191 * 0.125
        assert "00:23 left" in str(bar.bar), str(bar.bar)
    finally:
        bar.close()


def test_a_resumed_runs_estimate_counts_only_its_own_steps():
    now = [0.0]
    bar = RunProgress(100, initial=60, clock=lambda: now[0])
    try:
        for _ in range(11):
            now[0] += 0.5
            bar.train_row({"loss": 1.0, "bytes": 0.0})
        assert bar.steps == 71 and abs(bar.seconds_left() - 29 * 0.5) < 1e-9
    finally:
        bar.close()
