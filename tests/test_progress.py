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
