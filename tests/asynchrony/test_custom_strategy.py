"""The custom asynchronous strategy of docs/asynchronous.md (examples/async_custom_strategy.py) runs as shown, and its
server's updates come in the order of the nodes' speeds."""

import importlib.util
from pathlib import Path

import toy
from exogym import Trainer
from exogym.cluster.network import Network

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_custom_strategy_runs():
    spec = importlib.util.spec_from_file_location("async_custom_strategy", ROOT / "examples" / "async_custom_strategy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    t.fit(module.AsyncElasticAveraging(H=2), 3, batch_size=8, max_steps=4, node_speeds=[1.0, 0.5, 0.25],
          device_flops=1e4, network=Network(bandwidth="inf", latency=0.01), progress=False, device="cpu",
          logger=False)
    # a step's compute c (about 1 s here) dominates: node i's k-th update arrives at 2k c / s_i + (2k - 1) 0.01 s
    assert [u["node"] for u in t.record.updates] == [0, 1, 0, 2, 1, 2]
    assert "```python\n--8<-- \"examples/async_custom_strategy.py:custom\"" in (ROOT / "docs" / "asynchronous.md").read_text()
