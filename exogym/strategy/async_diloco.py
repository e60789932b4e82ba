"""Asynchronous DiLoCo: the server applies each node's pseudo-gradient as it arrives, weighted by its staleness."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.messages import Message
from exogym.strategy.optim import OptimSpec
from exogym.strategy.server_rounds import FlatServer, ServerRoundsStrategy

__all__ = ["AsyncDiLoCoStrategy", "AsyncDiLoCoServer", "STALENESS", "DELAYED_VARIANTS"]

STALENESS = ("constant", "polynomial")
DELAYED_VARIANTS = ("full_steps", "buffered")  # delayed_nesterov=True is the paper's Algorithm 3


def staleness_weight(staleness: int, rule: str, power: float) -> float:
    """constant: 1; polynomial: (1 + staleness)^-power (Liu et al. 2024 compare such weightings)."""
    return 1.0 if rule == "constant" else (1.0 + staleness) ** -power


class AsyncDiLoCoServer(FlatServer):
    """theta, the outer momentum m and the buffer Delta of the pseudo-gradients since the last momentum step. On each
    arrival g = w(staleness) x the node's pseudo-gradient, then the outer step of `rule`:

    - "nesterov" (no delay): m <- beta m + g; theta <- theta - lr (g + beta m)   (torch's SGD, nesterov=True)
    - "paper" (Delayed Nesterov, Liu et al. 2024, Algorithm 3, delay N, momentum activation c):
      Delta <- Delta + g; on every N-th arrival m <- beta m + Delta / N, theta <- theta - lr ((1 - cN + c) beta m
      + g / N), Delta <- 0; on the others theta <- theta - lr (c beta m + g / N).
    - "full_steps" (this project's earlier reading): Delta as above; every N-th arrival m <- beta m + Delta / N and
      theta <- theta - lr (g + beta m); the others theta <- theta - lr g (each pseudo-gradient at full size).
    - "buffered" (the toy simulator's `delayed_sgd`): Delta as above; every N-th arrival m <- beta m + Delta / N,
      theta <- theta - lr (Delta / N + beta m); theta does not move between.
    - outer_momentum = 0: theta <- theta - lr g.

    Over N arrivals "paper" with c = 0 and "buffered" move theta by the same total; "paper" applies each g / N at
    once, so a worker's next task starts from a model that has its update.
    """

    def __init__(self, theta: torch.Tensor, num_nodes: int, *, outer_lr: float, outer_momentum: float, rule: str,
                 delay: int, activation: float, staleness: str, staleness_power: float, **options: Any):
        super().__init__(theta, num_nodes, **options)
        self.lr, self.beta, self.delay, self.outer_rule, self.c = outer_lr, outer_momentum, delay, rule, activation
        self.rule, self.power = staleness, staleness_power
        self.momentum = torch.zeros_like(self.theta)
        self.buffer = torch.zeros_like(self.theta)
        self.arrivals = 0

    def apply(self, message: Message, staleness: int) -> None:
        weight = staleness_weight(staleness, self.rule, self.power)
        g = message.tensor.to(self.theta.dtype)  # the message's own tensor when it is theta's dtype: only read here
        if weight != 1.0:
            g = g * weight
        self.arrivals += 1
        momentum_step = self.beta > 0 and self.arrivals % self.delay == 0
        self.outer_step(g, momentum_step)
        self.version += 1
        self.record_update(node=message.src, staleness=staleness, weight=weight, version=self.version,
                           steps=int(message.meta["steps"]), momentum_step=int(momentum_step))

    def outer_step(self, g: torch.Tensor, momentum_step: bool) -> None:
        """theta (and m, Delta) after one arrival's weighted pseudo-gradient g, by the class docstring's rule."""
        lr, beta, n, theta = self.lr, self.beta, self.delay, self.theta
        if beta == 0:
            theta.sub_(g, alpha=lr)
            return
        if n == 1:  # every arrival is a momentum step, and Delta / N is g itself: no buffer to keep
            mean = g
        else:
            self.buffer.add_(g)
            mean = self.buffer * (1.0 / n) if momentum_step else None  # Delta / N
            if momentum_step:
                self.buffer.zero_()
        if momentum_step:
            self.momentum.mul_(beta).add_(mean)
        if self.outer_rule in ("nesterov", "full_steps"):
            theta.sub_(g + beta * self.momentum if momentum_step else g, alpha=lr)
        elif self.outer_rule == "buffered":
            if momentum_step:
                theta.sub_(mean + beta * self.momentum, alpha=lr)
        elif momentum_step:  # "paper", Algorithm 3
            theta.sub_((1.0 - self.c * n + self.c) * beta * self.momentum + g / n, alpha=lr)
        else:
            theta.sub_(self.c * beta * self.momentum + g / n if self.c else g / n, alpha=lr)

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
    arXiv:2401.09135, 2024, and its toy simulator (github.com/google-deepmind/asyncdiloco). What follows them:
    staleness weighting (constant, polynomial); Delayed Nesterov as Algorithm 3 with momentum activation c
    (AsyncDiLoCoServer has the rule); Dynamic Local Updates from measured speeds (sec. 4.2) or from the given ones
    (eq. 6, `"speeds"`); the framework's grace window, shard sampling and fresh inner optimizer per task (options,
    off by default). This project's reading where they leave room: the grace window's replies leave at its end
    (FlatServer); "undersampled" shard sampling (eq. 2) as the shards' data share less their step share
    (exogym.strategy.async_tasks); node r's first task is on shard r; the staleness weight multiplies the
    pseudo-gradient before every rule (the simulator also scales its vanilla updates by 1/sqrt(K), which is an
    outer-lr factor here). Two other delayed rules are kept by name: "full_steps" (ExoGym's earlier reading) and
    "buffered" (the simulator's `delayed_sgd`).

    Bytes per update: the node uploads the model's trainable parameters once (M bytes, plus 24 bytes of meta) and
    downloads M bytes (+16; +16 more under shard sampling): per node per step 2 M / H. The server receives and sends
    M per update.

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
        delayed_nesterov: False (Nesterov at every arrival); True (Delayed Nesterov, the paper's Algorithm 3);
            "full_steps" or "buffered" (the variants above).
        nesterov_delay: N, the arrivals between two momentum steps (default: num_nodes).
        momentum_activation: c of Algorithm 3, in [0, 1/N]: the share of the momentum applied at each arrival
            between two momentum steps (0, the paper's default: none).
        grace_s: The server's grace window in seconds (simulated, or wall-clock on the torch backend): the updates
            arriving within it are applied as they come, and their nodes all get its final model when it closes
            (0: every node is answered at once; the toy simulator used 0.5).
        dynamic_local_updates: False; True (learned from measured speeds); "speeds" (eq. 6 from fit's node_speeds).
        max_norm: Clip each inner step's gradient norm.
        time_budget_s: A node sits out its remaining steps once its clock (simulated seconds, or the run's
            seconds without a time model) reaches this (fast nodes then train more steps than slow ones in the same
            time; None: every node trains max_steps).
        **kwargs: `min_local_steps`, `shard_sampling`, `shard_seed`, `inner_state` (ServerRoundsStrategy) and the
            Strategy's options (`lr_scheduler`, ...).

    Raises:
        ValueError: An argument out of range (H < 1, outer_lr <= 0, outer_momentum outside [0, 1), an unknown
            staleness or delayed rule, a negative grace_s, momentum_activation outside [0, 1/N]), or one that means
            nothing without another (nesterov_delay or momentum_activation without Delayed Nesterov, Delayed
            Nesterov without outer momentum).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, lr: float | None = None,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, staleness: str = "constant",
                 staleness_power: float = 0.5, delayed_nesterov: bool | str = False, nesterov_delay: int | None = None,
                 momentum_activation: float = 0.0, grace_s: float = 0.0,
                 dynamic_local_updates: bool | str = False, time_budget_s: float | None = None,
                 max_norm: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, H=H, lr=lr, dynamic_local_updates=dynamic_local_updates,
                         time_budget_s=time_budget_s, max_norm=max_norm, **kwargs)
        check_number("outer_lr", outer_lr, positive=True, finite=True)
        check_number("outer_momentum", outer_momentum, minimum=0.0)
        if outer_momentum >= 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if staleness not in STALENESS:
            raise ValueError(f"staleness must be one of {list(STALENESS)}, got {staleness!r}")
        check_number("staleness_power", staleness_power, minimum=0.0)
        if not isinstance(delayed_nesterov, bool) and delayed_nesterov not in DELAYED_VARIANTS:
            raise ValueError(f"delayed_nesterov must be True (Algorithm 3), False or one of the variants "
                             f"{list(DELAYED_VARIANTS)}, got {delayed_nesterov!r}")
        if nesterov_delay is not None and delayed_nesterov is False:
            raise ValueError(f"nesterov_delay={nesterov_delay!r} only means something with delayed_nesterov")
        check_int("nesterov_delay", nesterov_delay, minimum=1, allow_none=True)
        if delayed_nesterov is not False and outer_momentum == 0:
            raise ValueError("delayed_nesterov needs outer_momentum > 0 (it delays the momentum step)")
        check_number("momentum_activation", momentum_activation, minimum=0.0, maximum=1.0)
        if momentum_activation and delayed_nesterov is not True:
            raise ValueError(f"momentum_activation={momentum_activation!r} is Algorithm 3's c and only means "
                             "something with delayed_nesterov=True")
        if nesterov_delay is not None and momentum_activation > 1.0 / nesterov_delay:
            raise ValueError(f"momentum_activation must be at most 1/N = 1/{nesterov_delay}, got "
                             f"{momentum_activation!r}")
        check_number("grace_s", grace_s, minimum=0.0, finite=True)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.staleness, self.staleness_power = staleness, staleness_power
        self.delayed_nesterov, self.nesterov_delay = delayed_nesterov, nesterov_delay
        self.momentum_activation, self.grace_s = momentum_activation, grace_s

    def check_nodes(self, num_nodes: int) -> None:
        if self.delayed_nesterov is True and self.nesterov_delay is None and \
                self.momentum_activation > 1.0 / num_nodes:
            raise ValueError(f"momentum_activation must be at most 1/N = 1/{num_nodes} (N = nesterov_delay, by "
                             f"default num_nodes={num_nodes}), got {self.momentum_activation!r}")

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> AsyncDiLoCoServer:
        """The run's server, made once where it runs.

        Args:
            theta: The global model's trainable parameters, flat.
            num_nodes: The run's node count.

        Returns:
            The AsyncDiLoCoServer.
        """
        if self.delayed_nesterov is False:
            rule, delay = "nesterov", 1
        else:
            rule = "paper" if self.delayed_nesterov is True else self.delayed_nesterov
            delay = self.nesterov_delay or num_nodes
        return AsyncDiLoCoServer(theta, num_nodes, H=self.H, outer_lr=self.outer_lr,
                                 outer_momentum=self.outer_momentum, rule=rule, delay=delay,
                                 activation=self.momentum_activation, staleness=self.staleness,
                                 staleness_power=self.staleness_power, grace_s=self.grace_s,
                                 **self.server_options(num_nodes))
