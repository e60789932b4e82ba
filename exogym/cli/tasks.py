"""Built-in tasks for the command line: a model and its train/validation data, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.data import Dataset, TensorDataset

from exogym.models import GPT, MLPClassifier, MnistCNN

__all__ = ["Task", "TASKS", "get_task"]


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    build: Callable[[], tuple[torch.nn.Module, Dataset, Dataset]]


def _mnist() -> tuple[torch.nn.Module, Dataset, Dataset]:
    from exogym.data.mnist import load_mnist
    torch.manual_seed(0)  # the same initial model for every strategy a comparison runs
    return MnistCNN(), load_mnist("train"), load_mnist("test")


def _synthetic() -> tuple[torch.nn.Module, Dataset, Dataset]:
    """A seeded 3-class problem with a known linear rule: seconds to train, no data to fetch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096 + 1024, 16, generator=g)
    y = (x @ torch.randn(16, 3, generator=g)).argmax(1)
    torch.manual_seed(0)
    return MLPClassifier(16, 3, hidden=32), TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])


def _shakespeare() -> tuple[torch.nn.Module, Dataset, Dataset]:
    """Character-level Shakespeare, blocks of 64 characters, a 4-layer GPT (~0.8M weights, dropout 0.1)."""
    from exogym.data.shakespeare import load_shakespeare
    train, val = load_shakespeare("train", block_size=64), load_shakespeare("val", block_size=64)
    torch.manual_seed(0)
    model = GPT(train.vocab.size, 64, n_layer=4, n_head=4, n_embd=128, dropout=0.1)
    return model, train, val


TASKS = {
    "mnist": Task("mnist", "real MNIST digits (60k train / 10k test), a small CNN", _mnist),
    "shakespeare": Task("shakespeare", "character-level Shakespeare (4.3M train / 0.5M val characters), a small GPT",
                        _shakespeare),
    "synthetic": Task("synthetic", "a seeded 3-class linear problem, a small MLP (fast)", _synthetic),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}") from None
