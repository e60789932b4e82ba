"""Asynchronous DiLoCo: the server applies each node's pseudo-gradient as it arrives, weighted by its staleness."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.messages import Message
from exogym.strategy.optim import OptimSpec
from exogym.strategy.server_rounds import FlatServer, ServerRoundsStrategy

__all__ = ["AsyncDiLoCoStrategy", "AsyncDiLoCoServer", "STALENESS"]

STALENESS = ("constant", "polynomial")


def staleness_weight(staleness: int, rule: str, power: float) -> float:
    """constant: 1; polynomial: (1 + staleness)^-power (Liu et al. 2024 compare such weightings)."""
    return 1.0 if rule == "constant" else (1.0 + staleness) ** -power


class AsyncDiLoCoServer(FlatServer):
    """theta, the outer momentum m, and (Delayed Nesterov) the buffer b of pseudo-gradients since the last
    momentum step. On each arrival g = w(staleness) Delta, then:

    - Nesterov (delay N = 1): m <- beta m + g; theta <- theta - lr (g + beta m)   (torch's SGD, nesterov=True)
    - Delayed Nesterov (N > 1): b <- b + g; on every N-th arrival m <- beta m + b / N, b <- 0 and
      theta <- theta - lr (g + beta m); on the others theta <- theta - lr g (a plain step with the pseudo-gradient).
    - outer_momentum = 0: theta <- theta - lr g.
    """

    def __init__(self, theta: torch.Tensor, num_nodes: int, *, H: int, dynamic_local_updates: bool, outer_lr: float,
                 outer_momentum: float, delay: int, staleness: str, staleness_power: float):
        super().__init__(theta, num_nodes, H, dynamic_local_updates)
        self.lr, self.beta, self.delay = outer_lr, outer_momentum, delay
        self.rule, self.power = staleness, staleness_power
        self.momentum = torch.zeros_like(self.theta)
        self.buffer = torch.zeros_like(self.theta)
        self.arrivals = 0

    def apply(self, message: Message, staleness: int) -> None:
        weight = staleness_weight(staleness, self.rule, self.power)
        g = message.tensor.to(self.theta.dtype) * weight
        self.arrivals += 1
        momentum_step = self.beta > 0 and self.arrivals % self.delay == 0
        if self.beta > 0:
            self.buffer.add_(g)
        if momentum_step:
            self.momentum.mul_(self.beta).add_(self.buffer, alpha=1.0 / self.delay)
            self.buffer.zero_()
            self.theta.sub_(g + self.beta * self.momentum, alpha=self.lr)
        else:
            self.theta.sub_(g, alpha=self.lr)
        self.version += 1
        self.record_update(node=message.src, staleness=staleness, weight=weight, version=self.version,
                           steps=int(message.meta["steps"]), momentum_step=int(momentum_step))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momentum": self.momentum.clone(), "buffer": self.buffer.clone(),
                "arrivals": self.arrivals}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum.copy_(state["momentum"])
        self.buffer.copy_(state["buffer"])
        self.arrivals = state["arrivals"]


class AsyncDiLoCoStrategy(ServerRoundsStrategy):
    """Asynchronous DiLoCo (Asynchronous Local-SGD): nodes send pseudo-gradients to a server that applies each arrival.

    Each node takes H inner steps (AdamW by default) from the global model it last received, sends its
    pseudo-gradient to a server and continues from the server's reply; the server applies every arrival at once,
    with an outer Nesterov step on the staleness-weighted pseudo-gradient. Nobody waits for a straggler.

    Paper: Liu, Chhaparia, Douillard et al., "Asynchronous Local-SGD Training for Language Modeling",
    arXiv:2401.09135, 2024: staleness weighting; Delayed Nesterov (the momentum updated only every N arrivals,
    plain steps with the pseudo-gradients between; AsyncDiLoCoServer has the exact rule); Dynamic Local Updates
    (H_i = max(1, floor(H v_i / max_j v_j)) from the nodes' measured speeds, so nodes finish together).

    Bytes per update: the node uploads the model's trainable parameters once (M bytes, plus 24 bytes of meta) and
    downloads M bytes (+16): per node per step 2 M / H. The server receives and sends M per update.

    Args:
        optim_spec: The inner optimizer (default AdamW, lr 1e-3).
        H: Inner steps per round (the fastest node's, under Dynamic Local Updates).
        lr: The inner optimizer's learning rate.
        outer_lr: The server's outer SGD learning rate.
        outer_momentum: The server's outer SGD momentum (Nesterov when > 0).
        staleness: `"constant"` (every pseudo-gradient weighs 1) or `"polynomial"`
            ((1 + staleness)^-staleness_power, staleness counting the server updates since the node's global
            model was sent).
        staleness_power: The exponent of `"polynomial"` staleness.
        delayed_nesterov: Momentum steps only every `nesterov_delay` arrivals.
        nesterov_delay: The arrivals between two momentum steps (default: num_nodes).
        dynamic_local_updates: Scale each node's H by its speed (learned from its rounds; H until known).
        max_norm: Clip each inner step's gradient norm.
        **kwargs: `time_budget_s`: a node sits out its remaining steps once its simulated clock reaches this
            (fast nodes then train more steps than slow ones in the same time; None: every node trains max_steps);
            and the Strategy's options (`lr_scheduler`, ...).

    Raises:
        ValueError: An argument out of range (H < 1, outer_lr <= 0, outer_momentum outside [0, 1), an unknown
            staleness rule, a nesterov_delay without delayed_nesterov).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, lr: float | None = None,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, staleness: str = "constant",
                 staleness_power: float = 0.5, delayed_nesterov: bool = False, nesterov_delay: int | None = None,
                 dynamic_local_updates: bool = False, max_norm: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, H=H, lr=lr, dynamic_local_updates=dynamic_local_updates, max_norm=max_norm,
                         **kwargs)
        check_number("outer_lr", outer_lr, positive=True, finite=True)
        check_number("outer_momentum", outer_momentum, minimum=0.0)
        if outer_momentum >= 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {list(STALENESS)}, got {staleness!r}")
        check_number("staleness_power", staleness_power, minimum=0.0)
        if not isinstance(delayed_nesterov, bool):
            raise TypeError(f"delayed_nesterov must be True or False, got {delayed_nesterov!r}")
        if nesterov_delay is not None and not delayed_nesterov:
            raise ValueError(f"nesterov_delay={nesterov_delay!r} only means something with delayed_nesterov=True")
        check_int("nesterov_delay", nesterov_delay, minimum=1, allow_none=True)
        if delayed_nesterov and outer_momentum == 0:
            raise ValueError("delayed_nesterov=True needs outer_momentum > 0 (it delays the momentum step)")
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.staleness, self.staleness_power = staleness, staleness_power
        self.delayed_nesterov, self.nesterov_delay = delayed_nesterov, nesterov_delay

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> AsyncDiLoCoServer:
        """The run's server, made once where it runs.

        Args:
            theta: The global model's trainable parameters, flat.
            num_nodes: The run's node count.

        Returns:
            The AsyncDiLoCoServer.
        """
        delay = (self.nesterov_delay or num_nodes) if self.delayed_nesterov else 1
        return AsyncDiLoCoServer(theta, num_nodes, H=self.H, dynamic_local_updates=self.dynamic_local_updates,
                                 outer_lr=self.outer_lr, outer_momentum=self.outer_momentum, delay=delay,
                                 staleness=self.staleness, staleness_power=self.staleness_power)
