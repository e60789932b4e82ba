"""The worker side shared by the server-based asynchronous strategies (AsyncDiLoCo, FedBuff).

Each node trains on its own clock: it takes its inner steps from the global model it last received, sends its
pseudo-gradient (the global model it started from minus its own parameters) to the server, and waits for the
server's reply: the global model as it stands after the server handled the message, with its version and the
number of inner steps the node should take next. Nobody waits for anybody else; the server (a
`FlatServer`) applies each arrival as its subclass says.

What a node sends per round: the model's trainable parameters (one flat tensor of their dtype) plus three numbers
of meta (the version it started from, its inner steps and the seconds they took, for staleness and Dynamic Local
Updates); it receives the same size back.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm import messages as msg
from exogym.strategy.base import Strategy, frozen_state, trainable_parameters
from exogym.strategy.server_strategy import ServerStrategy, flat_parameters
from exogym.strategy.optim import OptimSpec, ensure_optim_spec

__all__ = ["FlatServer", "ServerRoundsStrategy", "TimeBudget", "flat_parameters", "load_flat", "JOIN"]

JOIN = 1  # the tag of a node's request for the global model when it comes back after being down


class FlatServer(msg.Server):
    """A server holding the global model as one flat tensor `theta` and its `version` (updates applied so far).

    Each message is a node's pseudo-gradient with meta {version, steps, seconds}; `apply(message, staleness)`
    (the subclass) changes theta, and the node gets theta back with {version, H}."""

    def __init__(self, theta: torch.Tensor, num_nodes: int, H: int, dynamic_local_updates: bool):
        super().__init__()
        self.theta, self.version = theta.clone(), 0
        self.num_nodes, self.H, self.dynamic_local_updates = num_nodes, H, dynamic_local_updates
        self.speed: dict[int, float] = {}  # node -> inner steps per second in its last round

    def receive(self, message: msg.Message) -> None:
        if message.tag == JOIN:  # a node coming back: the global model as it stands, nothing applied
            self.send(message.src, self.theta, meta={"version": self.version, "H": self.steps_for(message.src)})
            return
        staleness = self.version - int(message.meta["version"])
        if message.meta["seconds"] > 0:
            self.speed[message.src] = message.meta["steps"] / message.meta["seconds"]
        self.apply(message, staleness)
        self.send(message.src, self.theta, meta={"version": self.version, "H": self.steps_for(message.src)})

    def apply(self, message: msg.Message, staleness: int) -> None:
        raise NotImplementedError

    def steps_for(self, rank: int) -> int:
        """Dynamic Local Updates (Liu et al. 2024, sec. 4.2): H_i = max(1, floor(H v_i / max_j v_j)), v the nodes'
        measured steps per second, so that nodes finish their rounds together; H until a node's speed is known."""
        if not self.dynamic_local_updates or rank not in self.speed:
            return self.H
        return max(1, int(self.H * self.speed[rank] / max(self.speed.values())))

    def snapshot(self) -> dict[str, Any]:
        return {"theta": self.theta.clone(), "version": self.version}

    def state_dict(self) -> dict[str, Any]:
        return {"theta": self.theta.clone(), "version": self.version, "speed": dict(self.speed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.theta.copy_(state["theta"])
        self.version, self.speed = state["version"], dict(state["speed"])


@torch.no_grad()
def load_flat(params: list[torch.nn.Parameter], theta: torch.Tensor) -> None:
    """Copy one flat tensor (as flat_parameters makes it) into the parameters, in place."""
    for p, chunk in zip(params, theta.split([p.numel() for p in params])):
        p.copy_(chunk.view_as(p))


class TimeBudget:
    """A node that sits out its remaining steps once its simulated clock reaches `time_budget_s` (None: never),
    so fast nodes train more steps than slow ones in the same simulated time. Its strategy sets `time_budget_s`
    and `_stopped`."""

    time_budget_s: float | None
    _stopped: bool

    def skip_compute(self) -> bool:
        """Whether this node sits out the step: once its clock has reached time_budget_s, and from then on."""
        if not self._stopped and self.time_budget_s is not None and msg.now() >= self.time_budget_s:
            self._stopped = True
        return self._stopped


class ServerRoundsStrategy(TimeBudget, ServerStrategy):
    """Base of AsyncDiLoCoStrategy and FedBuffStrategy: the node's inner loop and its exchange with the server
    (module docstring). Subclasses give `make_server(theta, num_nodes)`.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default: the class's, AdamW at lr 1e-3 here).
        H: Inner steps per round (a node's first round; with dynamic local updates the server sets the next).
        lr: The inner optimizer's learning rate.
        dynamic_local_updates: Scale each node's inner steps by its measured speed, so that nodes finish their
            rounds together.
        time_budget_s: A node sits out its remaining steps once its simulated clock reaches this (None: never).
        max_norm: Clip each inner step's gradient norm to this (None: no clipping).
        **kwargs: The Strategy base's settings (LR schedule, `lr_callbacks`, ...).

    Raises:
        TypeError: dynamic_local_updates that is not a bool.
        ValueError: H below 1, or a time budget that is not positive.
    """


    _default_inner = OptimSpec(torch.optim.AdamW, lr=1e-3)
    collectives_match_steps = True
    sends_messages = True
    @property
    def clock_runs_while_down(self) -> bool:
        """A node down spends its steps idle and comes back at its time (TrainNode); not once it has stopped at its
        time budget (its clock stays where it stopped)."""
        return not self._stopped

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, lr: float | None = None,
                 dynamic_local_updates: bool = False, time_budget_s: float | None = None,
                 max_norm: float | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        check_int("H", H, minimum=1)
        check_number("time_budget_s", time_budget_s, positive=True, allow_none=True)
        self.time_budget_s = time_budget_s
        if not isinstance(dynamic_local_updates, bool):
            raise TypeError(f"dynamic_local_updates must be True or False, got {dynamic_local_updates!r}")
        self.H, self.dynamic_local_updates = H, dynamic_local_updates
        spec = ensure_optim_spec(optim_spec, lr=lr) if optim_spec is not None else None
        if spec is None:
            spec = self._default_inner if lr is None else OptimSpec(self._default_inner.cls,
                                                                     **{**self._default_inner.kwargs, "lr": lr})
        self.optim_spec = spec

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> FlatServer:
        raise NotImplementedError

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self._params = trainable_parameters(model)
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        start = flat_parameters(model)
        self.server = msg.serve(lambda: self.make_server(start, num_nodes))
        self._start = start  # the global model this round started from
        self._version, self._steps, self._H = 0, 0, self.H
        self._round_began = msg.now()
        self._stopped = False

    def step(self) -> None:
        if self._stopped:
            Strategy.step(self)
            return
        self._clip_grads()
        self.optim.step()
        self._steps += 1
        if self._steps >= self._H:
            self._exchange()
        super().step()

    @torch.no_grad()
    def _exchange(self) -> None:
        """Send the pseudo-gradient Delta = theta_start - theta_node, take the server's theta as the new start."""
        delta = self._start - flat_parameters(self.model)
        msg.send(delta, msg.SERVER, meta={"version": self._version, "steps": self._steps,
                                          "seconds": msg.now() - self._round_began})
        reply = msg.recv(src=msg.SERVER)
        self._start = reply.tensor
        load_flat(self._params, reply.tensor)
        self._version, self._H = int(reply.meta["version"]), int(reply.meta["H"])
        self._steps, self._round_began = 0, msg.now()

    @torch.no_grad()
    def rejoin_alone(self) -> None:
        """A node coming back after being down: its unsent round is lost; it asks the server for the global model
        (an empty request, the model back) and starts a round from it. Nobody else waits."""
        msg.send(torch.zeros(0, dtype=self._start.dtype), msg.SERVER, tag=JOIN)
        reply = msg.recv(src=msg.SERVER)
        self._start = reply.tensor
        load_flat(self._params, reply.tensor)
        self._version, self._H = int(reply.meta["version"]), int(reply.meta["H"])
        self._steps, self._round_began = 0, msg.now()

    def finish(self) -> None:
        """The last, shorter round is sent; then every node's last update is in before the global model is read:
        the nodes meet once, at the end."""
        if self._steps:
            self._exchange()
        from exogym.comm.collectives import barrier
        barrier()

    def global_state(self) -> Mapping[str, torch.Tensor]:
        """The server's theta as of this node's clock (read_server: on any node, of any process or rank)."""
        theta = self._start if self.server is None else msg.read_server(lambda s: s.theta.clone())
        state = {name: chunk.view_as(p).to(p.device, p.dtype) for name, p, chunk in
                 zip(self._names, self._params, theta.split([p.numel() for p in self._params]))}
        return {**frozen_state(self.model), **state}

    def validation_facts(self) -> dict[str, float]:
        """What a validation row adds (node 0 reads the server): sim_time_s, node 0's clock; updates, the server
        updates applied by then. Loss against either: `exogym plot --x sim_time_s` or `--x updates`."""
        version = self._version if self.server is None else msg.read_server(lambda s: s.version)
        return {"sim_time_s": msg.now(), "updates": version}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        state["local"].update(start=self._start.clone(), version=self._version, steps=self._steps, H=self._H,
                              round_began=self._round_began, stopped=self._stopped)
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        local = state["local"]
        self._start = local["start"].clone()
        self._version, self._steps, self._H = local["version"], local["steps"], local["H"]
        self._round_began, self._stopped = local["round_began"], local["stopped"]
