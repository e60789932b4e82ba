"""Every built-in strategy and every simulated-cluster option from the command line: `exogym run`, `compare` and
`sweep` take the one table of options (exogym.cli.options), and `exogym sweep dashboard` is a command of its own."""

import json
from pathlib import Path

import pytest

import exogym.strategy as strategies
from exogym.cli.commands import build_parser, main
from exogym.cli.options import OPTIONS
from exogym.cli.strategies import STRATEGY_BUILDERS, options_read

# The strategy classes a user trains with; the rest of exogym.strategy's exports are bases and parts.
_BASES = {"Strategy", "ServerStrategy", "CommunicateOptimizeStrategy", "ServerRoundsStrategy"}
BUILT_IN = {getattr(strategies, n) for n in strategies.__all__ if n.endswith("Strategy") and n not in _BASES}


def _subparser(name: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices[name]


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's refusals
        status = e.code
    return status, capsys.readouterr().err


def test_every_built_in_strategy_has_a_command_line_name():
    defaults = _subparser("run").parse_args([])
    built = {type(builder(defaults)) for builder in STRATEGY_BUILDERS.values()}
    assert built == BUILT_IN, sorted(c.__name__ for c in BUILT_IN ^ built)  # a new strategy needs a name here
    assert len(BUILT_IN) == 12 and sorted(STRATEGY_BUILDERS) == sorted(
        ["ddp", "diloco", "sparta", "fedavg", "demo", "streaming-diloco", "sparta-diloco", "dgc", "async-diloco",
         "fedbuff", "decoupled-diloco", "gossip"])


@pytest.mark.parametrize("name", sorted(STRATEGY_BUILDERS))
def test_exogym_run_trains_each_strategy_on_a_simulated_network(name, capsys):
    # Before: only ddp, demo, diloco, fedavg and sparta, and `--network home` was "unrecognized arguments".
    rounds = ["--H", "8"] if "H" in options_read(STRATEGY_BUILDERS[name], vars(_subparser("run").parse_args([]))) \
        else []  # only where the strategy has rounds: --H to DDP would change nothing, an error
    argv = ["run", "--strategy", name, "--nodes", "2", "--steps", "8", *rounds, "--val-size", "16",
            "--batch-size", "8", "--network", "home", "--quiet", "--run-name", name]
    status, err = _run(capsys, argv)
    assert status == 0, err
    config = json.loads(Path(f"logs/{name}/config.json").read_text())
    assert config["strategy"] == type(STRATEGY_BUILDERS[name](_subparser("run").parse_args(argv[1:]))).__name__
    assert "home" in config["time_model"]["network"].lower() or "100" in config["time_model"]["network"]
    rows = Path(f"logs/{name}/train.csv").read_text().splitlines()
    assert len(rows) >= 2 and "sim_time_s" in rows[0]


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_run_compare_and_sweep_take_every_option_of_the_one_table(command):
    flags = {s for a in _subparser(command)._actions for s in a.option_strings}
    missing = [o.flag for o in OPTIONS if o.flag not in flags]
    # A sweep's runs take their seeds from --seeds and their folders from --out; --cosine is a switch, not swept.
    assert missing == ([] if command != "sweep" else ["--cosine", "--seed", "--device", "--log-dir", "--overwrite"])
    assert {"--network", "--node-speeds", "--failure-rate", "--slowdown-rate", "--active-nodes",
                            "--time-budget"} <= {o.flag for o in OPTIONS}


def test_the_simulated_cluster_from_the_command_line_reaches_the_run(capsys):
    status, err = _run(capsys, ["run", "--strategy", "async-diloco", "--nodes", "2", "--steps", "6", "--H", "2",
                                "--val-size", "16", "--batch-size", "8", "--network", "low", "--node-speeds", "1,0.5",
                                "--failure-rate", "0.1", "--downtime", "2", "--slowdown-rate", "0.01",
                                "--time-budget", "1000", "--quiet", "--run-name", "cluster"])
    assert status == 0, err
    config = json.loads(Path("logs/cluster/config.json").read_text())
    assert config["time_model"]["node_speeds"] == [1.0, 0.5] and "slowdowns" in config["time_model"]
    assert "RandomFailures(rate=0.1" in config["membership"]["failures"]
    assert config["strategy_config"]["time_budget_s"] == 1000.0


def test_compare_takes_the_cluster_options_too(capsys):
    status, err = _run(capsys, ["compare", "--strategies", "ddp", "gossip", "--nodes", "2", "--steps", "2",
                                "--val-size", "16", "--batch-size", "8", "--network", "home", "--node-speeds", "0.5",
                                "--quiet", "--prefix", "c-", "--out", "c.png"])
    assert status == 0, err
    for name in ("ddp", "gossip"):
        assert json.loads(Path(f"logs/c-{name}/config.json").read_text())["time_model"]["node_speeds"] == [0.5, 0.5]


@pytest.mark.parametrize("argv, needle", [
    (["run", "--strategy", "ddp", "--time-budget", "5"], "--time-budget: not an option of ddp"),
    (["compare", "--strategies", "ddp", "diloco", "--buffer-size", "3"], "--buffer-size: not an option of ddp or "
                                                                         "diloco"),
    (["run", "--strategy", "gossip", "--time-budget", "5"], "--time-budget needs --gossip-mode async"),
    (["run", "--node-speeds", "1,0"], "argument --node-speeds: takes speeds > 0"),
    (["run", "--nodes", "4", "--node-speeds", "1,0.5"], "--node-speeds gives 2 speeds for --nodes 4"),
    (["run", "--strategy", "demo", "--optim", "sgd"], "demo is its own optimizer"),
    (["run", "--strategy", "dgc", "--optim", "adamw"], "DGCStrategy applies its sparse update with SGD"),
])
def test_an_option_that_would_change_nothing_or_cannot_hold_is_refused_in_one_line(argv, needle, capsys):
    status, err = _run(capsys, argv + ["--steps", "1", "--quiet"])
    assert status == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not Path("logs").exists()  # refused before anything ran


def test_sweep_dashboard_is_a_command_of_its_own(capsys):
    sweep_help = _subparser("sweep").format_help()
    # Before: `[dashboard FOLDER|URL ...]` a trailing positional among the sweep's options, --port and --host too.
    assert "[dashboard FOLDER|URL ...]" not in sweep_help and "--port" not in sweep_help
    sub = next(a for a in _subparser("sweep")._actions if a.dest == "sweep_command")
    dashboard = sub.choices["dashboard"].format_help()
    assert "FOLDER|URL" in dashboard and "--port" in dashboard and "--host" in dashboard
    status, err = _run(capsys, ["sweep", "dashbord", "s"])
    assert status == 2 and "invalid choice: 'dashbord'" in err, err


def test_a_sweep_sweeps_the_cluster_options(capsys):
    status, err = _run(capsys, ["sweep", "--strategies", "fedbuff", "--nodes", "2", "--steps", "2", "--H", "2",
                                "--val-size", "16", "--batch-size", "8", "--network", "home", "low",
                                "--node-speeds", "1,0.5", "--quiet", "--out", "s"])
    assert status == 0, err
    configs = [json.loads(p.read_text()) for p in sorted(Path("s").rglob("config.json"))]
    assert sorted(c["time_model"]["network"].split("(")[0] for c in configs) == sorted(
        c["time_model"]["network"].split("(")[0] for c in configs) and len(configs) == 2
    assert {json.dumps(c["time_model"]["node_speeds"]) for c in configs} == {"[1.0, 0.5]"}
    assert len({c["time_model"]["network"] for c in configs}) == 2
