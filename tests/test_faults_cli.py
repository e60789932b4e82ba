"""Hostile input to the command line and to the API's argument checks (issue 30, item 9).

Every refused command is one line on stderr and exit status 2, before anything trains; a run that starts and fails
is one line with its reason and run folder, status 1; Ctrl-C is status 130; a traceback only with --debug. The
checks live in the API (Trainer.fit, the strategies, OptimSpec), so a Python caller gets the same refusals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import toy
import exogym.fit.nodes as fit_setup
from exogym import Trainer
from exogym._validation import MAX_SEED
from exogym.cli.commands import main
from exogym.fit.nodes import NODE_OVERHEAD_BYTES, available_memory_bytes, build_node_batches, check_node_memory
from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy, SPARTAStrategy,
                             Strategy)
from exogym.strategy.optim import OptimSpec

ROOT = Path(__file__).resolve().parents[1]
# A small run of the synthetic task: what a hostile option is added to.
RUN = ["run", "--task", "synthetic", "--nodes", "2", "--steps", "3", "--val-size", "16", "--quiet"]
FIT = dict(logger=False, progress=False, device="cpu")


def _command(capsys, argv: list[str]) -> tuple[int, str]:
    """The exit status of `exogym argv` run in this process, and its stderr, which must be one line, no traceback."""
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusals exit
        status = e.code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, f"{argv}: {err!r}"
    return status, err


# (argv, what the one line must say): each is refused with status 2 before anything trains.
HOSTILE = [
    ([], "the following arguments are required: command"),
    (["run", "--nodes", ""], "--nodes: must be an integer >= 1, got ''"),
    (["run", "--nodes", "-1"], "--nodes: must be >= 1, got -1"),
    (["run", "--nodes", "0"], "--nodes: must be >= 1, got 0"),
    (["run", "--nodes", "1e3"], "--nodes: must be an integer >= 1, got '1e3'"),
    (["run", "--nodes", "four"], "got 'four'"),
    (["run", "--nodes", "nan"], "got 'nan'"),
    (RUN + ["--nodes", "1000000000000"], "num_nodes=1000000000000 needs at least"),
    (RUN + ["--nodes", str(10**9)], "is available; use at most"),
    (RUN + ["--nodes", "5000"], "fewer than one step needs (num_nodes=5000 x batch_size=32"),
    (["run", "--steps", "-5"], "--steps: must be >= 1, got -5"),
    (["run", "--steps", "0"], "--steps: must be >= 1, got 0"),
    (["run", "--steps", "2.5"], "--steps: must be an integer >= 1, got '2.5'"),
    (["run", "--batch-size", "0"], "--batch-size: must be >= 1"),
    (RUN + ["--batch-size", str(10**30)], "fewer than one step needs"),
    (["run", "--lr", "inf"], "--lr: must be a finite number, got inf"),
    (["run", "--lr", "1e999"], "--lr: must be a finite number, got 1e999"),
    (["run", "--lr", "-inf"], "--lr: expected one argument"),
    (["run", "--lr", "nan"], "--lr: must be > 0, got nan"),
    (["run", "--lr", "0"], "--lr: must be > 0, got 0"),
    (["run", "--lr", "-1"], "--lr: must be > 0, got -1"),
    (["run", "--lr", "fast"], "--lr: must be a number, got 'fast'"),
    (["run", "--lr"], "--lr: expected one argument"),
    (["run", "--max-norm", "inf"], "--max-norm: must be a finite number"),
    (["run", "--max-norm", "0"], "--max-norm: must be > 0"),
    (["run", "--strategy", "diloco", "--outer-lr", "inf"], "--outer-lr: must be a finite number"),
    (["run", "--strategy", "diloco", "--outer-lr", "nan"], "--outer-lr: must be > 0, got nan"),
    (["run", "--strategy", "sparta", "--p-sparta", "2"], "--p-sparta: must be at most 1"),
    (["run", "--strategy", "sparta", "--p-sparta", "0"], "--p-sparta: must be > 0"),
    (["run", "--failure-rate", "1.5"], "--failure-rate: must be at most 1"),
    (["run", "--failure-rate", "-0.1"], "--failure-rate: must be >= 0"),
    (["run", "--failure-rate", "1.0"], "--failure-rate: must be below 1 (at 1 every node fails at every step), got 1.0"),
    (["run", "--slowdown-rate", "-1"], "--slowdown-rate: must be >= 0"),
    (["run", "--slowdown-factor", "0.5"], "--slowdown-factor: must be >= 1 (a factor of 2 halves the node's speed)"),
    (["run", "--slowdown-duration", "0"], "--slowdown-duration: must be > 0"),
    (RUN + ["--val-size", "1e9"], "--val-size: must be an integer >= 1, got '1e9'"),
    (RUN + ["--val-size", str(10**9)], f"--val-size {10**9} is more than the"),
    (["run", "--H", "0"], "--H: must be >= 1, got 0"),
    (["run", "--strategy", "demo", "--topk", "0"], "--topk: must be >= 1"),
    (RUN + ["--strategy", "fedavg", "--island-size", "9"], "island_size must divide the 2 nodes"),
    (RUN + ["--strategy", "fedavg", "--nodes", "4", "--island-size", "3"], "(num_nodes=4, client_sampling=1.0), got 3; "
                                                                           "use one of [1, 2, 4]"),
    (RUN + ["--strategy", "fedavg", "--island-size", str(10**20)], f"got {10**20}"),
    (["run", "--seed", "1180591620717411303424"], f"--seed: must be at most {MAX_SEED}"),
    (["run", "--seed", str(2**64)], f"--seed: must be at most {MAX_SEED}, got {2**64}"),
    (["run", "--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["run", "--seed", "1.5"], "--seed: must be an integer"),
    *[(RUN + ["--run-name", name], "run_name must be a folder name") for name in ("", ".", "..", "a/b", "   ")],
    (RUN + ["--run-name", "a\nb"], "got 'a\\nb'"),  # the newline shown as \n: the message stays one line
    (RUN + ["--run-name", "x" * 300], "it has 300 characters"),
    (["run", "--log-dir", ""], "--log-dir: must not be empty"),
    (RUN + ["--log-dir", "afile"], "'afile' is a file"),
    (RUN + ["--log-dir", "afile/sub"], "'afile' is a file"),
    (["run", "--device", ""], "--device: must not be empty"),
    (RUN + ["--device", "tpu"], "invalid device 'tpu'"),
    (RUN + ["--optim", "adamx"], "unknown optimizer name 'adamx'"),
    (RUN + ["--optim", ""], "argument --optim: must not be empty"),
    (["run", "--task", "nope"], "--task: invalid choice: 'nope'"),
    (["run", "--strategy", "nope"], "--strategy: invalid choice: 'nope'"),
    (["run", "--active-nodes", "sometimes"], "--active-nodes: invalid choice"),
    (RUN + ["--nodes", "1", "--active-nodes", "doubling"], "needs num_nodes >= 2, got 1"),
    (["run", "--nodez", "4"], "unrecognized arguments: --nodez 4"),
    (["fly"], "invalid choice: 'fly'"),
    (["compare", "--strategies", "ddp", "ddp"], "--strategies names one strategy twice"),
    (["compare", "--prefix", "../", "--strategies", "ddp"], "--prefix '../' makes the run name '../ddp'"),
    (["compare", "--prefix", "a\n", "--strategies", "ddp"], "it holds a control character"),
    (["compare", "--out", ""], "--out: must not be empty"),
    (["compare", "--strategies", "fedsgd"], "invalid choice: 'fedsgd'"),
    (["plot", "nowhere"], "'nowhere' is not a run folder"),
    (["plot", "afile"], "'afile' is not a run folder"),
    (["plot", "nowhere", "--x", "epochs"], "--x: invalid choice: 'epochs'"),
    (["plot"], "the following arguments are required: runs"),
    (["sweep"], "--out names the sweep folder"),
    (["sweep", "--out", "afile"], "--out names the sweep folder, got 'afile' (a file)"),
    (["sweep", "--out", "s", "--retry-failed"], "--retry-failed goes with --resume"),
    (["sweep", "--resume", "nowhere"], "'nowhere' holds no sweep"),
    (["sweep", "--out", "s", "--strategies", "fedavg", "--island-size", "9"], "island_size must divide the 4 nodes"),
    (["sweep", "--out", "s", "--seeds", "0", str(2**64)], f"--seeds: a seed must be in 0..{MAX_SEED}, got {2**64}"),
    (["sweep", "--out", "s", "--nodes", "4", str(10**12)], "num_nodes=1000000000000 needs at least"),
    (["sweep", "--out", "s", "--lr", "1e-3:inf"], "--lr: must be a finite number"),
    (["data", "mnist", "--torchvision-root", "afile"], "--torchvision-root must name a folder, got 'afile' (a file)"),
    (["data", "mnist"], "the following arguments are required: --torchvision-root"),
    (["data"], "the following arguments are required: dataset"),
]


def test_every_hostile_command_is_one_line_and_status_2(capsys):
    Path("afile").write_text("a file where a folder is expected")
    for argv, needle in HOSTILE:
        status, err = _command(capsys, argv)
        assert status == 2, f"{argv}: status {status}: {err}"
        assert needle in err, f"{argv}: {err}"
    assert not Path("logs").exists() and not Path("s").exists()  # refused before any run or sweep took a folder


def test_run_name_rule_comes_before_existing_folders(capsys):
    Path("logs").mkdir()  # "" and "." would name logs/ itself, which exists: the rule is what is wrong
    for name in ("", ".", ".."):
        status, err = _command(capsys, RUN + ["--run-name", name])
        assert status == 2 and "run_name must be a folder name" in err and "already exist" not in err, err
    assert main(RUN + ["--run-name", "a.b-c_d 1"]) == 0  # the boundary: dots, dashes, spaces inside are a name
    assert Path("logs/a.b-c_d 1/train.csv").is_file()


def test_compare_checks_every_strategy_before_the_first_run(capsys):
    status, err = _command(capsys, ["compare"] + RUN[1:] + ["--strategies", "ddp", "fedavg", "--nodes", "4",
                                                            "--island-size", "3"])
    assert status == 2 and "island_size must divide the 4 nodes" in err, err
    assert not Path("logs").exists()  # ddp, first in line, did not run either


def test_a_run_that_diverges_is_one_line_status_1_naming_its_folder(capsys):
    status, err = _command(capsys, RUN + ["--steps", "50", "--val-interval", "25", "--lr", "1e30",
                                          "--run-name", "diverged"])
    assert status == 1, err
    assert err.startswith("exogym run: error: the run failed: NonFiniteLoss: ") and "non-finite" in err, err
    assert "run folder: logs/diverged" in err and Path("logs/diverged/train.csv").is_file(), err


def test_ctrl_c_and_sigterm_are_one_line_with_128_plus_the_signal(capsys, monkeypatch):
    class Stopped(KeyboardInterrupt):  # what fit raises for SIGTERM: a KeyboardInterrupt naming its signal
        signal_name = "SIGTERM"

    def interrupted(self, *args, **kwargs):
        error = raised.pop()
        error.run_folder = "logs/stopped"
        raise error

    monkeypatch.setattr(Trainer, "fit", interrupted)
    raised = [Stopped("the run was stopped by SIGTERM"), KeyboardInterrupt()]
    status, err = _command(capsys, RUN)
    assert status == 130 and err.startswith("exogym run: interrupted (Ctrl-C)") and "logs/stopped" in err, err
    status, err = _command(capsys, RUN)
    assert status == 128 + signal.SIGTERM and "interrupted (SIGTERM): the run was stopped by SIGTERM" in err, err


def test_errors_of_a_started_run_and_internal_errors_are_status_1(capsys, monkeypatch):
    def fails_in_node(self, *args, **kwargs):
        error = RuntimeError("the all-reduce met a shape it did not expect")
        error.add_note("(raised in node 1 at step 3)")
        raise error

    monkeypatch.setattr(Trainer, "fit", fails_in_node)
    status, err = _command(capsys, RUN)
    assert status == 1 and "the run failed: RuntimeError: the all-reduce" in err and "node 1 at step 3" in err, err

    def fails_before_its_first_row(self, *args, **kwargs):
        error = FloatingPointError("the validation loss is non-finite at step 1")
        error.run_folder, error.record = None, None  # what fit sets: the run gave its folder back
        raise error

    monkeypatch.setattr(Trainer, "fit", fails_before_its_first_row)
    status, err = _command(capsys, RUN)
    assert status == 1 and "the run failed: FloatingPointError" in err and "no run folder was kept" in err, err

    import exogym.cli.commands as cli

    def broken(args):
        raise AttributeError("a bug")

    monkeypatch.setitem(cli.STRATEGY_BUILDERS, "ddp", broken)
    status, err = _command(capsys, RUN)
    assert status == 1 and "internal error: AttributeError: a bug; please report it" in err, err
    with pytest.raises(AttributeError, match="a bug"):  # --debug: the traceback
        main(["--debug"] + RUN)


@pytest.mark.spawns
def test_ctrl_c_on_a_real_run_exits_130_with_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "exogym.cli", "run", "--steps", "1000000", "--nodes", "2",
                             "--quiet", "--run-name", "stopped"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rows = tmp_path / "logs" / "stopped" / "train.csv"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and \
            (not rows.is_file() or rows.read_text().count("\n") < 2):  # training: its first rows are written
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.strip()
    assert proc.returncode == 130, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "interrupted (Ctrl-C)" in err, err
    assert "logs/stopped" in err, err


# ---- the API: every argument checked against the others before any node starts ---------------------------------

def _trainer(n: int = 64) -> Trainer:
    return Trainer(toy.TinyMLP(), toy.make_classification(n), toy.make_classification(16, seed=1))


def test_island_size_is_checked_against_num_nodes_before_any_node_starts():
    with pytest.raises(ValueError, match=r"island_size must divide the 4 nodes taking part in a round \(num_nodes=4, "
                                         r"client_sampling=1.0\), got 9; use one of \[1, 2, 4\]") as info:
        _trainer().fit(FedAvgStrategy(H=2, island_size=9), 4, batch_size=4, max_steps=2, **FIT)
    assert not any("raised in node" in n for n in getattr(info.value, "__notes__", ()))  # no node ran
    with pytest.raises(ValueError, match=r"island_size must divide the 2 nodes .*client_sampling=0.5\), got 4"):
        FedAvgStrategy(island_size=4, client_sampling=0.5).check_nodes(4)  # 2 of the 4 nodes take part
    FedAvgStrategy(island_size=2, client_sampling=0.5).check_nodes(4)  # the boundary: islands of all who take part
    _trainer().fit(FedAvgStrategy(H=2, island_size=4), 4, batch_size=4, max_steps=2, **FIT)


def test_strategies_are_asked_about_the_node_count():
    seen = []

    class NeedsEvenNodes(toy.LocalOnly):
        def check_nodes(self, num_nodes):
            seen.append(num_nodes)
            if num_nodes % 2:
                raise ValueError(f"NeedsEvenNodes needs an even num_nodes, got {num_nodes}")

    with pytest.raises(ValueError, match="needs an even num_nodes, got 3"):
        _trainer().fit(NeedsEvenNodes(), 3, batch_size=4, max_steps=1, **FIT)
    _trainer().fit(NeedsEvenNodes(), 2, batch_size=4, max_steps=1, **FIT)
    assert seen == [3, 2]
    Strategy.check_nodes(SimpleReduceStrategy(), 10**12)  # the default checks nothing


def test_seed_range_is_what_torch_generators_take():
    with pytest.raises(ValueError, match=rf"seed must be in 0..{MAX_SEED}, got {2**70}"):
        _trainer().fit(SimpleReduceStrategy(), 2, batch_size=4, max_steps=1, seed=2**70, **FIT)
    with pytest.raises(ValueError, match=rf"seed must be in 0..{MAX_SEED}, got {MAX_SEED + 1}"):
        _trainer().fit(SimpleReduceStrategy(), 2, batch_size=4, max_steps=1, seed=MAX_SEED + 1, **FIT)
    # The boundary, over 3 epochs (each epoch's data order is seeded with seed + epoch) and validation's choice.
    t = _trainer(16)
    t.fit(SimpleReduceStrategy(), 2, batch_size=4, max_steps=6, seed=MAX_SEED, val_interval=3, **FIT)
    assert len(t.record.train) == 6


@pytest.mark.parametrize("build", [
    lambda lr: SimpleReduceStrategy(lr=lr), lambda lr: DiLoCoStrategy(lr=lr), lambda lr: DiLoCoStrategy(outer_lr=lr),
    lambda lr: FedAvgStrategy(lr=lr), lambda lr: SPARTAStrategy(lr=lr), lambda lr: DeMoStrategy(lr=lr),
    lambda lr: SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=lr)), lambda lr: OptimSpec("adamw", lr=lr)])
def test_a_learning_rate_must_be_finite(build):
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="lr"):
            build(bad)
    build(1e30)  # finite: refused by nothing but the run itself, which fails on its non-finite loss


def test_optim_spec_refuses_non_finite_hyperparameters_and_a_negative_lr():
    with pytest.raises(ValueError, match=r"OptimSpec\(AdamW\) got lr=inf; lr must be finite"):
        OptimSpec(torch.optim.AdamW, lr=float("inf"))
    with pytest.raises(ValueError, match=r"OptimSpec\(AdamW\) got betas=\(0.9, nan\); betas must be finite"):
        OptimSpec(torch.optim.AdamW, betas=(0.9, float("nan")))
    with pytest.raises(ValueError, match=r"OptimSpec\(SGD\) got lr=-0.1; a learning rate must be >= 0"):
        OptimSpec(torch.optim.SGD, lr=-0.1)
    assert OptimSpec(torch.optim.SGD, lr=0.0).kwargs == {"lr": 0.0}  # the boundary: lr 0 trains nothing, allowed
    OptimSpec(torch.optim.SGD, lr=torch.tensor(0.1))  # a tensor lr is the optimizer's to check


class _Untouchable(torch.utils.data.Dataset):
    """A dataset that fails if a check reads its examples or builds a node's batches from it."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        raise AssertionError("read an example")


def test_a_billion_nodes_are_refused_from_the_arguments_alone(monkeypatch):
    monkeypatch.setattr(fit_setup, "available_memory_bytes", lambda: 10 * 10**9)
    monkeypatch.setattr(fit_setup, "NodeBatches", lambda *a, **k: pytest.fail("built a node's batches"))
    with pytest.raises(ValueError, match=r"num_nodes=1000000000 needs at least 119.2 TB of memory on this machine "
                                         r"\(1000000000 node\(s\) x 128.0 KB of exogym's per-node state\), but "
                                         r"9.3 GB is available; use at most 76293 nodes, or free some memory"):
        Trainer(toy.TinyMLP(), _Untouchable()).fit(SimpleReduceStrategy(), 10**9, batch_size=1, **FIT)


def test_node_memory_estimate_counts_model_copies_once_per_node_on_a_cpu(monkeypatch):
    model = torch.nn.Linear(1000, 1000)  # 4,004,000 bytes of parameters
    params = 4_004_000
    per_node = NODE_OVERHEAD_BYTES + params
    monkeypatch.setattr(fit_setup, "available_memory_bytes", lambda: 10 * per_node)
    check_node_memory(10, model=model)  # the boundary: exactly what is available
    with pytest.raises(ValueError, match=r"num_nodes=11 needs at least .* \+ 11 node\(s\) on the CPU x their model "
                                         r"copy of 3.8 MB\), but .* use at most 10 nodes, a smaller model"):
        check_node_memory(11, model=model)
    # DDP keeps one replica: the parameters once, whatever the node count.
    check_node_memory(60, model=model, one_replica=True)
    # Nodes on a GPU hold their copies there: the machine's memory holds their per-node state only.
    check_node_memory(60, model=model, devices=[torch.device("cuda", 0)] * 60)
    with pytest.raises(ValueError, match=r"30 node\(s\) on the CPU"):
        check_node_memory(60, model=model, devices=[torch.device("cuda", 0), torch.device("cpu")] * 30)
    monkeypatch.setattr(fit_setup, "available_memory_bytes", lambda: None)  # unknown: nothing to check against
    check_node_memory(10**12, model=model)


def test_under_torchrun_a_machine_holds_its_share_of_the_nodes(monkeypatch):
    monkeypatch.setattr(fit_setup, "available_memory_bytes", lambda: 100 * NODE_OVERHEAD_BYTES)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 4 machines
    check_node_memory(400)
    with pytest.raises(ValueError, match=r"num_nodes=404 .*\(101 node\(s\)"):
        check_node_memory(404)


def test_available_memory_is_read_from_the_machine():
    available = available_memory_bytes()
    if sys.platform.startswith("linux"):
        assert isinstance(available, int) and available > 0
    else:
        assert available is None or available > 0


def test_too_little_data_is_refused_before_any_node_is_built(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(fit_setup, "NodeBatches", lambda *a, **k: pytest.fail("built a node's batches"))
        with pytest.raises(ValueError, match=r"the training data has 64 examples, fewer than one step needs "
                                             r"\(num_nodes=100000 x batch_size=2 = 200000\)"):
            build_node_batches(_Untouchable(), None, num_nodes=100_000, batch_size=2, shuffle=True, seed=0)
    # The boundary: 64 examples over 16 nodes are shards of 4, one batch of 4 each.
    batches = build_node_batches(toy.make_classification(64), None, num_nodes=16, batch_size=4, shuffle=True, seed=0)
    assert [nb.steps_per_epoch for nb in batches] == [1] * 16
