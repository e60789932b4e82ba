"""Run functions for the sweep tests, at module level so that sweep worker processes can import them."""

from __future__ import annotations

import time

from exogym import Trainer
from exogym.strategy import DiLoCoStrategy
from toy import TinyMLP, make_classification


class _Slow(TinyMLP):
    """TinyMLP whose every forward sleeps (4 ms): a run long enough to be killed in the middle (after its first
    checkpoint at step 5 the test polls every 50 ms, for 25 steps of 2 nodes and their validations)."""

    def forward(self, batch):
        time.sleep(0.004)
        return super().forward(batch)


def tiny(config: dict, run) -> object:
    """DiLoCo on 2 nodes, a few steps of a tiny MLP; config: H, outer_lr, seed, and (tests) steps, fail, poison."""
    if config.get("fail"):
        raise ValueError("this configuration fails on purpose")
    train, val = make_classification(256), make_classification(64, seed=1)
    if config.get("poison"):  # nan inputs: the first loss is nan, and exogym stops the run
        train.tensors[0][:] = float("nan")
    model = (_Slow if config.get("slow") else TinyMLP)()
    trainer = Trainer(model, train, val)
    trainer.fit(DiLoCoStrategy("sgd", lr=0.1, H=config.get("H", 5), outer_lr=config.get("outer_lr", 0.7)), 2,
                max_steps=config.get("steps", 10), batch_size=8, val_interval=5, val_size=64, seed=config["seed"],
                **run.fit_kwargs)
    return trainer.record


def slow(config: dict, run) -> object:
    return tiny({**config, "slow": True, "steps": 30}, run)


def unslowed(config: dict, run) -> object:
    """slow's runs without the sleeps: the same numbers, for a reference sweep nobody kills."""
    return tiny({**config, "steps": 30}, run)


def kill_sweep(out: str, resume: str = "") -> None:
    """The kill test's sweep, started as `python -c "import sweep_runs; sweep_runs.kill_sweep(out)"` (so that its
    functions are sweep_runs.*, whichever process runs them)."""
    from exogym.sweep import grid, sweep
    sweep(slow, grid(H=[2, 4, 5], seed=[0]), out=out, workers=None if resume else 2, checkpoint_interval=5,
          resume=bool(resume), progress=False)


def tradeoff(config: dict, run) -> object:
    """tiny, with a metric that falls as H falls (and the bytes grow): a loss-vs-bytes front of several points."""
    return tiny(config, run), {"held_out": config["H"] / 10 + abs(config["outer_lr"] - 0.5)}


CALLS: list = []


def stops_after_three(config: dict, run) -> object:
    """tiny for three runs, then Ctrl-C (as a user stopping a sweep that would run for ever)."""
    CALLS.append(dict(config))
    if len(CALLS) > 3:
        raise KeyboardInterrupt
    return tiny(config, run)
