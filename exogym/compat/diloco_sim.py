"""DilocoSimulator: the earlier diloco-sim simulator's arguments, run by exogym's Trainer and DiLoCo.

Scripts written for diloco-sim keep working: the model is built from model_cls(**model_kwargs),
the loss is loss_fn(model(x), y), nodes synchronise every diloco_interval local steps with an
outer Nesterov SGD (lr 0.7, momentum 0.9) by default, and the hooks receive TrainStats every
step and EvalStats every eval_interval steps. Everything else (sharding, per-node random
streams, byte counts, the sim backend) is exogym's. Checkpoints (exogym's format, resumable with
Trainer.fit(resume_from=...)) go to save_dir every ckpt_interval outer steps; save_dir without
ckpt_interval saves one, at the end of training.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import Dataset

from exogym import Trainer
from exogym._validation import check_int, check_number
from exogym.runs.loggers import Logger
from exogym.strategy.optim import OptimSpec

__all__ = ["DilocoSimulator", "TrainStats", "EvalStats"]


@dataclass(frozen=True)
class TrainStats:
    """Passed to train_loss_hook after every local step (loss averaged over the nodes)."""

    step: int
    loss: float
    perplexity: float


@dataclass(frozen=True)
class EvalStats:
    """Passed to eval_loss_hook after every evaluation of the global model."""

    step: int
    loss: float
    perplexity: float
    accuracy: float | None = None


class _LossModel(torch.nn.Module):
    """model(batch) -> loss, as exogym expects, from diloco-sim's (model, loss_fn) pair."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        out = self.model(x)
        metrics = {"loss": self.loss_fn(out, y)}
        if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():  # classification: report accuracy
            metrics["accuracy"] = (out.argmax(dim=1) == y).float().mean()
        return metrics


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class _HookLogger(Logger):
    def __init__(self, train_hook: Callable[[TrainStats], Any] | None, eval_hook: Callable[[EvalStats], Any] | None):
        self.train_hook, self.eval_hook = train_hook, eval_hook

    def log(self, table: str, row: dict[str, float]) -> None:
        if table == "train" and self.train_hook is not None:
            self.train_hook(TrainStats(int(row["step"]), row["loss"], _perplexity(row["loss"])))
        elif table == "val" and self.eval_hook is not None:
            self.eval_hook(EvalStats(int(row["step"]), row["global_loss"], _perplexity(row["global_loss"]),
                                     row.get("global_accuracy")))


class DilocoSimulator:
    """diloco-sim's interface. `train()` runs it and returns the trained model (model_cls's instance)."""

    def __init__(self, model_cls: type[torch.nn.Module], model_kwargs: dict[str, Any] | None = None,
                 optimizer_kwargs: dict[str, Any] | None = None, train_dataset: Dataset | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, num_nodes: int = 4, diloco_interval: int = 500,
                 batch_size: int = 16, eval_dataset: Dataset | None = None,
                 optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW, ckpt_interval: int | None = None,
                 eval_iters: int = 50, save_dir: str | os.PathLike | None = None,
                 outer_optimizer_cls: type[torch.optim.Optimizer] = torch.optim.SGD,
                 outer_optimizer_kwargs: dict[str, Any] | None = None, max_local_step: int | None = None,
                 num_epochs: int = 1, cosine_anneal: bool = False,
                 train_loss_hook: Callable[[TrainStats], Any] | None = None,
                 eval_loss_hook: Callable[[EvalStats], Any] | None = None, p_sparta: float = 0.0,
                 warmup_steps: int = 0, max_norm: float | None = None, eval_interval: int = 100,
                 devices: list[Any] | None = None, seed: int = 0, backend: str = "sim", progress: bool = True):
        if not (inspect.isclass(model_cls) and issubclass(model_cls, torch.nn.Module)):
            raise TypeError(f"model_cls must be a torch.nn.Module subclass (the class, not an instance), got {model_cls!r}")
        if train_dataset is None or loss_fn is None:
            raise TypeError("DilocoSimulator needs train_dataset and loss_fn (called as loss_fn(model(x), y))")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(model(x), y), got {loss_fn!r}")
        check_int("num_nodes", num_nodes, minimum=1)
        check_int("diloco_interval", diloco_interval, minimum=1)
        check_int("batch_size", batch_size, minimum=1)
        check_int("eval_iters", eval_iters, minimum=1)
        check_int("eval_interval", eval_interval, minimum=1)
        check_int("ckpt_interval", ckpt_interval, minimum=1, allow_none=True)
        check_int("max_local_step", max_local_step, minimum=1, allow_none=True)
        check_number("p_sparta", p_sparta, minimum=0.0, maximum=1.0)
        if ckpt_interval is not None and save_dir is None:
            raise ValueError("ckpt_interval needs save_dir, the folder the checkpoints go to")
        for name, cls in (("optimizer_cls", optimizer_cls), ("outer_optimizer_cls", outer_optimizer_cls)):
            if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
                raise TypeError(f"{name} must be a torch.optim.Optimizer subclass, got {cls!r}")
        self.model_cls, self.model_kwargs = model_cls, dict(model_kwargs or {})
        self.loss_fn, self.train_dataset, self.eval_dataset = loss_fn, train_dataset, eval_dataset
        self.num_nodes, self.diloco_interval, self.batch_size = num_nodes, diloco_interval, batch_size
        self.inner = OptimSpec(optimizer_cls, **dict(optimizer_kwargs or {}))
        self.outer = OptimSpec(outer_optimizer_cls, **(outer_optimizer_kwargs if outer_optimizer_kwargs is not None
                                                       else {"lr": 0.7, "nesterov": True, "momentum": 0.9}))
        self.ckpt_interval, self.save_dir, self.eval_iters, self.eval_interval = ckpt_interval, save_dir, eval_iters, eval_interval
        self.max_local_step, self.num_epochs, self.cosine_anneal = max_local_step, num_epochs, cosine_anneal
        self.train_loss_hook, self.eval_loss_hook = train_loss_hook, eval_loss_hook
        self.p_sparta, self.warmup_steps, self.max_norm = p_sparta, warmup_steps, max_norm
        self.devices, self.seed, self.backend, self.progress = devices, seed, backend, progress
        self.trainer: Trainer | None = None

    def _strategy(self):
        from exogym.strategy import DiLoCoStrategy, SPARTADiLoCoStrategy

        schedule = {"warmup_steps": self.warmup_steps, "cosine_anneal": self.cosine_anneal} \
            if (self.warmup_steps or self.cosine_anneal) else {}
        common = dict(optim_spec=self.inner, outer_optim_spec=self.outer, H=self.diloco_interval,
                      max_norm=self.max_norm, **schedule)
        if self.p_sparta > 0:
            return SPARTADiLoCoStrategy(p_sparta=self.p_sparta, **common)
        return DiLoCoStrategy(**common)

    def train(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)  # the model's initial weights, as diloco-sim seeded them
        wrapped = _LossModel(self.model_cls(**self.model_kwargs), self.loss_fn)
        self.trainer = Trainer(wrapped, self.train_dataset, self.eval_dataset, devices=self.devices)
        ckpt = {}
        if self.ckpt_interval is not None:  # diloco-sim counts checkpoints in outer steps
            ckpt = dict(checkpoint_interval=self.ckpt_interval * self.diloco_interval, checkpoint_dir=self.save_dir)
        elif self.save_dir is not None:  # a folder without an interval: one checkpoint, at the end of training
            ckpt = dict(checkpoint_dir=self.save_dir)
        final = self.trainer.fit(self._strategy(), self.num_nodes, num_epochs=self.num_epochs,
                                 max_steps=self.max_local_step, batch_size=self.batch_size,
                                 val_size=self.eval_iters * self.batch_size, val_interval=self.eval_interval,
                                 seed=self.seed, backend=self.backend, log_interval=1, progress=self.progress,
                                 logger=_HookLogger(self.train_loss_hook, self.eval_loss_hook), **ckpt)
        return final.model
