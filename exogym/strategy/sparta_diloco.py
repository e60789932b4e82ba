"""SPARTA-DiLoCo: sparse parameter averaging every step and a DiLoCo outer step every H steps."""

from __future__ import annotations

from typing import Any

from exogym.strategy.communicate_optimize_strategy import ModularStrategy
from exogym.strategy.diloco import _one_of, diloco_module
from exogym.strategy.optim import OptimSpec
from exogym.strategy.sparta import SparseCommunicator

__all__ = ["SPARTADiLoCoStrategy"]


class SPARTADiLoCoStrategy(ModularStrategy):
    """SPARTA-DiLoCo: sparse averaging after every inner step, and DiLoCo's outer step every H steps.

    After every inner step a fraction `p_sparta` of the entries is averaged across the nodes (SPARTA,
    shared-seed indices); every H steps the pseudo-gradients are averaged and the outer optimizer moves the
    global model, from which every node continues (DiLoCo). The sparse averaging keeps the nodes close, which
    lets H grow far beyond what DiLoCo alone tolerates.

    Papers: Beton et al. 2025 (SPARTA, which proposes the combination); Douillard et al. 2023 (DiLoCo).
    Bytes per node per step: 2 (K-1)/K x (p_sparta + 1/H) x the model's bytes.
    A node whose pseudo-gradient is dropped keeps its local progress (see DiLoCoStrategy).

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default AdamW, lr 1e-3).
        outer_optim_spec: The outer optimizer, as in DiLoCoStrategy.
        H: Inner steps per DiLoCo round.
        p_sparta: The fraction of each parameter's entries averaged per step (as in SPARTAStrategy).
        sparsification_mode: How the entries are chosen (as in SPARTAStrategy).
        async_delay: The averaged values arrive this many steps late (as in SPARTAStrategy).
        inner_optim: The same as `optim_spec` (pass one of them).
        outer_optim: The same as `outer_optim_spec` (pass one of them).
        lr: The inner optimizer's learning rate.
        inner_lr: The same as `lr` (pass one of them).
        weight_decay: The inner optimizer's weight decay.
        outer_lr: The outer optimizer's learning rate.
        outer_momentum: The outer SGD's momentum.
        nesterov: Whether the outer SGD's momentum is Nesterov's.
        drop_prob: Each round each node's pseudo-gradient is lost with this probability (as in DiLoCoStrategy).
        seed: The seed of the shared random streams.
        final_sync: One more round at the end of a run whose last step is not a round's last.
        max_norm: Clip the global gradient norm to this before each inner step.
        sparta_interval: Sparse averaging after every `sparta_interval`-th step.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
                    `cosine_anneal`, `min_lr_factor`), and, after an optimizer name or class, that optimizer's own
                    options (`momentum=0.9`, `betas=...`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: Both spellings of an option are given, or an unknown keyword.
        ValueError: A value out of range.
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None,
                 outer_optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, p_sparta: float = 0.005,
                 sparsification_mode: str = "random", async_delay: int = 0,
                 inner_optim: OptimSpec | str | type | None = None, outer_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, inner_lr: float | None = None, weight_decay: float | None = None,
                 outer_lr: float | None = None, outer_momentum: float | None = None, nesterov: bool | None = None,
                 drop_prob: float = 0.0, seed: int = 0, final_sync: bool = True, max_norm: float | None = None,
                 sparta_interval: int = 1, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=_one_of("lr", lr, "inner_lr", inner_lr),
                         weight_decay=weight_decay, **kwargs)
        if sparsification_mode == "topk":
            raise ValueError("SPARTA-DiLoCo averages shared-seed entries (no indices): sparsification_mode 'random', "
                             "'sequential', 'partitioned' or 'blockwise'; top-k's shared model would go stale at "
                             "every DiLoCo reset")
        sparse = SparseCommunicator(p_sparta, sparsification_mode=sparsification_mode, async_delay=async_delay,
                                    seed=seed, interval=sparta_interval)
        outer = diloco_module(H, outer_optim_spec, outer_optim, outer_lr=outer_lr, outer_momentum=outer_momentum,
                              nesterov=nesterov, drop_prob=drop_prob, seed=seed, final_sync=final_sync)
        self._use_modules([sparse, outer])

    @property
    def H(self) -> int:
        """Inner steps per DiLoCo round."""
        return self.modules[1].H
