"""The custom asynchronous strategy of docs/asynchronous.md (examples/async_custom_strategy.py) runs as shown, its
server's updates come in the order of the nodes' speeds, and it keeps ServerStrategy's contract (resume, the server's
model as the result); docs/custom_strategy.md's whole script runs as pasted and plots against updates."""

import importlib.util
from pathlib import Path

import torch

import toy
from exogym import Trainer
from exogym.cluster.network import Network

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("async_custom_strategy", ROOT / "examples" / "async_custom_strategy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_custom_strategy_runs():
    module = _example()
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    t.fit(module.AsyncElasticAveraging(H=2), 3, batch_size=8, max_steps=4, node_speeds=[1.0, 0.5, 0.25],
          device_flops=1e4, network=Network(bandwidth="inf", latency=0.01), progress=False, device="cpu",
          logger=False)
    # a step's compute c (about 1 s here) dominates: node i's k-th update arrives at 2k c / s_i + (2k - 1) 0.01 s
    assert [u["node"] for u in t.record.updates] == [0, 1, 0, 2, 1, 2]
    assert "```python\n--8<-- \"examples/async_custom_strategy.py:custom\"" in (ROOT / "docs" / "asynchronous.md").read_text()


def test_the_server_strategy_of_custom_strategy_md_runs_as_pasted_and_plots_against_updates(tmp_path, monkeypatch):
    """docs/custom_strategy.md's strategy with a server, its block whole (imports included) run as a script, then
    `exogym plot --x updates` on its run folder (a custom server strategy's validation rows carry `updates`: before
    ServerStrategy the plot refused it until the undocumented validation_facts() was found)."""
    import re

    from exogym.cli import main

    page = (ROOT / "docs" / "custom_strategy.md").read_text()
    section = page[page.index("## A strategy with a server"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).split("#")[0].split()
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "custom_strategy.md", "exec"), {"__name__": "__main__"})
    rows = (tmp_path / "logs" / "elastic" / "val.csv").read_text().splitlines()
    assert "updates" in rows[0].split(",") and len(rows) == 1 + 5  # steps 0, 10, 20, 30, 40
    assert command[:2] == ["exogym", "plot"] and main(command[1:]) == 0
    assert (tmp_path / "elastic.png").stat().st_size > 1000



def test_a_custom_server_strategy_resumes_bit_identically_and_returns_the_servers_model(tmp_path):
    """ServerStrategy's contract on the documented example: a checkpoint holds the server's state (its
    state_dict) with the messages in flight, so the resumed run ends bit-identical; the model fit returns is the
    server's theta as node 0 read it at the end."""
    module = _example()
    fit = dict(batch_size=8, node_speeds=[1.0, 0.5, 0.25], network="home", progress=False, device="cpu",
               logger=False)
    toy.assert_resumes_bit_identically(lambda: module.AsyncElasticAveraging(H=2), lambda: Trainer(
        toy.TinyMLP(), toy.make_classification(256)), tmp_path, nodes=3, steps=8, **fit)
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    seen = {}

    class Keeps(module.AsyncElasticAveraging):
        def finish(self):
            super().finish()
            if self.rank == 0:
                seen["theta"] = self.server.theta.clone()

    model = t.fit(Keeps(H=2), 3, max_steps=8, **fit)
    assert torch.equal(torch.nn.utils.parameters_to_vector(model.parameters()), seen["theta"])
