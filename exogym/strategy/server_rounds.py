"""The worker side shared by the server-based asynchronous strategies (AsyncDiLoCo, FedBuff).

Each node trains on its own clock: it takes its inner steps from the global model it last received, sends its
pseudo-gradient (the global model it started from minus its own parameters) to the server, and waits for the
server's reply: the global model as it stands after the server handled the message, with its version and the
number of inner steps the node should take next. Nobody waits for anybody else; the server (a
`FlatServer`) applies each arrival as its subclass says.

What a node sends per round: the model's trainable parameters (one flat tensor of their dtype) plus three numbers
of meta (the version it started from, its inner steps and the seconds they took, for staleness and Dynamic Local
Updates); it receives the same size back (with shard sampling, two more numbers: the next task's shard and where
in it the task starts).

The asynchronous Local-SGD framework's task options (Liu et al., arXiv:2401.09135; exogym.strategy.async_tasks):
shard sampling (`shard_sampling=`, with each shard's own LR schedule), a fresh inner optimizer per task
(`inner_state="reset"`), and Dynamic Local Updates learned from measured speeds (`True`) or from the given ones
(`"speeds"`, eq. 6). The grace window is AsyncDiLoCo's (`FlatServer(grace_s=)`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm import messages as msg
from exogym.comm.flatten import flatten_in_place
from exogym.strategy.async_tasks import SHARD_SAMPLING, ShardLR, ShardReader, ShardSampler, speed_steps
from exogym.strategy.base import Strategy, frozen_state, trainable_parameters
from exogym.strategy.lr_schedule import lambda_cosine
from exogym.strategy.server_strategy import ServerStrategy, flat_parameters
from exogym.strategy.optim import OptimSpec, ensure_optim_spec

__all__ = ["FlatServer", "ServerRoundsStrategy", "TimeBudget", "flat_parameters", "load_flat", "JOIN"]

JOIN = 1  # the tag of a node's request for the global model when it comes back after being down


class FlatServer(msg.Server):
    """A server holding the global model as one flat tensor `theta` and its `version` (updates applied so far).

    Each message is a node's pseudo-gradient with meta {version, steps, seconds}; `apply(message, staleness)`
    (the subclass) changes theta, and the node gets theta back with {version, H} (and {shard, offset}, its next
    task's data, under shard sampling). `local_steps` counts the inner steps of every update applied.

    The grace window (`grace_s` > 0; the asynchronous Local-SGD framework's, Liu et al. 2024, and its toy
    simulator's `max_wait_time`): an update that arrives while no window is open is applied and opens one of
    grace_s seconds; every update arriving within it is applied at its arrival, and the nodes that sent them all
    get the window's final model when it closes, each with its next task. This project's reading where the paper
    leaves room: the replies leave at the window's end (the toy simulator restarts those workers at the last
    arrival inside the window, which a real server could not know before the window has passed), and a node
    coming back (JOIN) is answered at once.

    Args:
        theta: The global model's trainable parameters, flat.
        num_nodes: The run's node count.
        H: Inner steps per task (the fastest node's under Dynamic Local Updates).
        dynamic_local_updates: False, True (learned from measured speeds) or "speeds" (from `static_steps`).
        grace_s: The grace window in seconds (0: every node is answered at once).
        static_steps: Each node's steps under dynamic_local_updates="speeds" (eq. 6, from the given speeds).
        min_steps: The fewest steps learned Dynamic Local Updates give a node.
        sampler: The shard of each task (None: node r reads its own shard r).
    """

    def __init__(self, theta: torch.Tensor, num_nodes: int, H: int, dynamic_local_updates: bool | str, *,
                 grace_s: float = 0.0, static_steps: list[int] | None = None, min_steps: int = 1,
                 sampler: ShardSampler | None = None):
        super().__init__()
        self.theta, self.version = theta.clone(), 0
        self.num_nodes, self.H, self.dynamic_local_updates = num_nodes, H, dynamic_local_updates
        self.grace_s, self.static_steps, self.min_steps, self.sampler = grace_s, static_steps, min_steps, sampler
        self.speed: dict[int, float] = {}  # node -> inner steps per second in its last round
        self.local_steps = 0  # inner steps folded into theta: the papers' "total local updates"
        self.held: list[int] = []  # the nodes whose updates the open grace window applied, waiting for its end
        self.window_end: float | None = None

    def receive(self, message: msg.Message) -> None:
        if message.tag == JOIN:  # a node coming back: the global model as it stands, nothing applied
            self.reply(message.src)
            return
        staleness = self.version - int(message.meta["version"])
        if message.meta["seconds"] > 0:
            self.speed[message.src] = message.meta["steps"] / message.meta["seconds"]
        self.apply(message, staleness)
        self.local_steps += int(message.meta["steps"])
        if self.grace_s == 0:
            self.reply(message.src)
            return
        if self.window_end is None:  # this arrival opens a window; it closes at wake()
            self.window_end = self.now + self.grace_s
            self.wake_at(self.window_end)
        self.held.append(message.src)

    def wake(self, at: float) -> None:
        """The grace window closes: every node whose update it applied gets its final model."""
        if at != self.window_end:
            return
        held, self.held, self.window_end = self.held, [], None
        for rank in held:
            self.reply(rank)

    def reply(self, rank: int) -> None:
        """Send node `rank` the global model with its next task: its steps (and, under shard sampling, its shard and
        the position where the task starts in it)."""
        steps = self.steps_for(rank)
        meta = {"version": self.version, "H": steps}
        if self.sampler is not None:
            shard, offset = self.sampler.assign(steps)
            meta.update(shard=shard, offset=offset)
        self.send(rank, self.theta, meta=meta)

    def apply(self, message: msg.Message, staleness: int) -> None:
        raise NotImplementedError

    def steps_for(self, rank: int) -> int:
        """Dynamic Local Updates (Liu et al. 2024, sec. 4.2): H_i = max(min_steps, floor(H v_i / max_j v_j)).
        Learned (True): v the nodes' measured steps per second in their last rounds, H until a node's speed is
        known. "speeds": eq. 6 from the given speeds, the same from the first task on."""
        if self.dynamic_local_updates == "speeds":
            return self.static_steps[rank]
        if not self.dynamic_local_updates or rank not in self.speed:
            return self.H
        return max(self.min_steps, int(self.H * self.speed[rank] / max(self.speed.values())))

    def snapshot(self) -> dict[str, Any]:
        return {"theta": self.theta.clone(), "version": self.version}

    def state_dict(self) -> dict[str, Any]:
        state = {"theta": self.theta.clone(), "version": self.version, "speed": dict(self.speed),
                 "local_steps": self.local_steps, "held": list(self.held), "window_end": self.window_end}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.theta.copy_(state["theta"])
        self.version, self.speed = state["version"], dict(state["speed"])
        self.local_steps, self.held, self.window_end = state["local_steps"], list(state["held"]), state["window_end"]
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])


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
    """The base of the strategies that train against a server in rounds (AsyncDiLoCoStrategy, FedBuffStrategy,
    DecoupledDiLoCoStrategy): each node runs H inner steps, sends its pseudo-gradient to the server and takes back
    the model the server answers with, on its own clock (exogym.strategy.server_rounds). A subclass gives
    `make_server(theta, num_nodes)` (building it with `server_options`), the server that holds the global model and
    applies what arrives.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default: the class's, AdamW at lr 1e-3 here).
        H: Inner steps per round (a node's first round; with dynamic local updates the server sets the next).
        lr: The inner optimizer's learning rate.
        dynamic_local_updates: Scale each node's inner steps by its speed, so that nodes finish their rounds
            together: False; True (learned from each node's measured speed, H until known); or "speeds" (the
            paper's eq. 6 from the speeds fit was given, `node_speeds` x `device_flops`, from the first task on;
            all equal without them).
        min_local_steps: The fewest inner steps Dynamic Local Updates give a node (default 1; the toy simulator
            used 5).
        shard_sampling: None (node r reads shard r, as every strategy), "least_visited" (each task on a shard
            with the fewest tasks so far, ties drawn; the toy simulator's rule) or "undersampled" (a shard drawn in
            proportion to how far it is under its share of the steps: the paper's eq. 2 as read here). A shard's
            batches are one stream that each task on it continues; an LR schedule ("cosine") then runs per shard,
            over the shard's own steps (the run's max_steps each), not per node.
        shard_seed: The seed of the shard draws (only with shard_sampling).
        shard_steps: Each shard's total steps, the length of its LR schedule under shard sampling (default: the
            run's max_steps; the toy simulator's is H x its rounds).
        inner_state: "keep" (the inner optimizer's state goes on across rounds) or "reset" (a fresh inner
            optimizer state for every task, as the toy simulator builds a new AdamW per task).
        time_budget_s: A node sits out its remaining steps once its simulated clock reaches this (None: never).
        max_norm: Clip each inner step's gradient norm to this (None: no clipping).
        **kwargs: The Strategy base's settings (LR schedule, `lr_callbacks`, ...).

    Raises:
        TypeError: An argument of the wrong type (dynamic_local_updates neither a bool nor "speeds").
        ValueError: H below 1, a time budget that is not positive, an unknown shard_sampling or inner_state, a
            setting that means nothing without another (min_local_steps without dynamic_local_updates,
            shard_seed or shard_steps without shard_sampling), or shard sampling with an LR schedule that is not lambda_cosine.
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
                 dynamic_local_updates: bool | str = False, min_local_steps: int | None = None,
                 shard_sampling: str | None = None, shard_seed: int | None = None, shard_steps: int | None = None,
                 inner_state: str = "keep",
                 time_budget_s: float | None = None, max_norm: float | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        check_int("H", H, minimum=1)
        check_number("time_budget_s", time_budget_s, positive=True, allow_none=True)
        self.time_budget_s = time_budget_s
        if not isinstance(dynamic_local_updates, bool) and dynamic_local_updates != "speeds":
            raise TypeError(f"dynamic_local_updates must be True (learned from measured speeds), \"speeds\" (from "
                            f"fit's node_speeds, eq. 6) or False, got {dynamic_local_updates!r}")
        check_int("min_local_steps", min_local_steps, minimum=1, allow_none=True)
        if min_local_steps is not None and not dynamic_local_updates:
            raise ValueError(f"min_local_steps={min_local_steps!r} only means something with dynamic_local_updates "
                             "(True or \"speeds\")")
        if min_local_steps is not None and min_local_steps > H:
            raise ValueError(f"min_local_steps={min_local_steps} is more than H={H}; use at most {H}")
        if shard_sampling is not None and shard_sampling not in SHARD_SAMPLING:
            raise ValueError(f"shard_sampling must be None or one of {list(SHARD_SAMPLING)}, got {shard_sampling!r}")
        check_int("shard_seed", shard_seed, minimum=0, allow_none=True)
        for name, value in (("shard_seed", shard_seed), ("shard_steps", shard_steps)):
            if value is not None and shard_sampling is None:
                raise ValueError(f"{name}={value!r} only means something with shard_sampling")
        check_int("shard_steps", shard_steps, minimum=1, allow_none=True)
        if shard_sampling is not None and self.lr_schedule is not None and self.lr_schedule.kind != "lambda_cosine":
            raise ValueError("shard_sampling runs the LR schedule per shard, over each shard's own steps, and takes "
                             "lr_scheduler='cosine', 'constant' or 'lambda_cosine' (or none); got "
                             f"{self.lr_schedule.kind!r}")
        if inner_state not in ("keep", "reset"):
            raise ValueError(f"inner_state must be 'keep' or 'reset', got {inner_state!r}")
        self.H, self.dynamic_local_updates = H, dynamic_local_updates
        self.min_local_steps = 1 if min_local_steps is None else min_local_steps
        self.shard_sampling, self.shard_seed, self.inner_state = shard_sampling, shard_seed or 0, inner_state
        self.shard_steps = shard_steps
        spec = ensure_optim_spec(optim_spec, lr=lr) if optim_spec is not None else None
        if spec is None:
            spec = self._default_inner if lr is None else OptimSpec(self._default_inner.cls,
                                                                     **{**self._default_inner.kwargs, "lr": lr})
        self.optim_spec = spec

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> FlatServer:
        """The run's server, made once where it runs.

        Args:
            theta: The global model's parameters as one flat tensor (the server keeps its own copy).
            num_nodes: The run's nodes.

        Returns:
            The server (a FlatServer subclass: its `receive` applies what a node sends and answers it).
        """
        raise NotImplementedError

    def server_options(self, num_nodes: int) -> dict[str, Any]:
        """The FlatServer keywords of the task options (Dynamic Local Updates, shard sampling), for make_server.

        Args:
            num_nodes: The run's node count.

        Returns:
            {dynamic_local_updates, static_steps, min_steps, sampler}.
        """
        sampler = None
        if self.shard_sampling is not None:
            sizes = list(self._context().shard_sizes) or [1] * num_nodes
            sampler = ShardSampler(self.shard_sampling, sizes, [self.first_steps(r) for r in range(num_nodes)],
                                   self.shard_seed)
        return {"dynamic_local_updates": self.dynamic_local_updates, "static_steps": self._speed_steps(num_nodes),
                "min_steps": self.min_local_steps, "sampler": sampler}

    def _speed_steps(self, num_nodes: int) -> list[int] | None:
        if self.dynamic_local_updates != "speeds":
            return None
        speeds = list(self._context().node_speeds) or [1.0] * num_nodes
        return speed_steps(self.H, speeds, self.min_local_steps)

    def check_data(self, node_batches: list[Any], *, processes: int) -> None:
        """Before any node starts (fit asks): shard sampling reads other nodes' shards, so it needs one dataset
        sharded over the nodes, all of it in every process.

        Args:
            node_batches: Every node's NodeBatches.
            processes: The processes the run spans.

        Raises:
            ValueError: Shard sampling with each node's own data (a factory, a partition), or over processes.
        """
        if self.shard_sampling is None:
            return
        if processes > 1:
            raise ValueError(f"shard_sampling runs in one process (the sim backend, processes=1): a node reads other "
                             f"nodes' shards, which a run over {processes} processes does not give it")
        node_batches[0].of_shard(0)  # refuses data that is each node's own

    def first_steps(self, rank: int) -> int:
        """Node `rank`'s first task's inner steps: H, or eq. 6's under dynamic_local_updates="speeds".

        Args:
            rank: The node.

        Returns:
            Its first task's inner steps.
        """
        steps = self._speed_steps(self.num_nodes)
        return self.H if steps is None else steps[rank]

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self._params = trainable_parameters(model)
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        # One buffer under the parameters: a round's pseudo-gradient and reload are one operation each.
        self._flat = flatten_in_place(self._params)
        self._flat_at = [p.data_ptr() for p in self._params]
        start = flat_parameters(model)
        self.server = msg.serve(lambda: self.make_server(start, num_nodes))
        self._start = start  # the global model this round started from
        self._version, self._steps, self._H = 0, 0, self.first_steps(rank)
        self._round_began = msg.now()
        self._stopped = False
        self._reader: ShardReader | None = None
        self._shard, self._offset = rank, 0  # the current task's shard and where it began in it

    def read_batches(self, batches: Any, from_step: int) -> Any:
        """The node's batches, one per step (the engine draws them): its own shard's, or under shard sampling its
        current task's shard's, from the task's position.

        Args:
            batches: The node's NodeBatches.
            from_step: The first step the node runs.

        Returns:
            An iterator of batches.

        Raises:
            ValueError: Shard sampling on data that is not one dataset sharded over the nodes, or over processes.
        """
        if self.shard_sampling is None:
            return batches.iterate(from_step=from_step)
        batches.of_shard(self._shard)  # refuses data a node cannot read other shards of, before the first step
        self._reader = ShardReader(batches.of_shard, self._shard, self._offset + self._steps)
        return self._reader

    def build_scheduler(self) -> None:
        if self.shard_sampling is None or self.lr_schedule is None or self.scheduler is not None:
            super().build_scheduler()
            return
        sched = self.lr_schedule  # lambda_cosine, over each shard's own steps (the run's max_steps by default)
        length = self.shard_steps or self.max_steps
        self.scheduler = ShardLR(self.optim, lambda_cosine(warmup_steps=sched.warmup_steps, max_steps=length,
                                                           cosine_anneal=sched.cosine_anneal,
                                                           min_lr_factor=sched.min_lr_factor))
        self.scheduler.at(self._offset + self._steps)

    def step(self) -> None:
        if self._stopped:
            Strategy.step(self)
            return
        self._clip_grads()
        self.optim.step()
        self._steps += 1
        if self._steps >= self._H:
            self._exchange()
        if isinstance(self.scheduler, ShardLR):
            self.scheduler.at(self._offset + self._steps)  # the next step's place in its shard
        super().step()

    @torch.no_grad()
    def _exchange(self) -> None:
        """Send the pseudo-gradient Delta = theta_start - theta_node, take the server's theta as the new start."""
        flat = self._own_flat()
        if flat is not None:
            delta = self._start - flat.to(self._start.device)
        else:
            flat = flat_parameters(self.model)
            delta = torch.sub(self._start, flat, out=flat)  # into the flat copy: no second model-sized tensor
        msg.send(delta, msg.SERVER, meta={"version": self._version, "steps": self._steps,
                                          "seconds": msg.now() - self._round_began}, copy=False)  # made to be sent
        self._begin_task(msg.recv(src=msg.SERVER))

    def _own_flat(self) -> torch.Tensor | None:
        """The buffer the parameters are views of, while they still are (fused execution re-homes them)."""
        if self._flat is None or [p.data_ptr() for p in self._params] != self._flat_at:
            return None
        return self._flat

    def _begin_task(self, reply: msg.Message) -> None:
        """Start the task the server's reply hands over: its global model, version, steps and shard."""
        self._start = reply.tensor
        flat = self._own_flat()
        if flat is not None:
            with torch.no_grad():
                flat.copy_(reply.tensor)
        else:
            load_flat(self._params, reply.tensor)
        self._version, self._H = int(reply.meta["version"]), int(reply.meta["H"])
        self._steps, self._round_began = 0, msg.now()
        if "shard" in reply.meta:
            self._shard, self._offset = int(reply.meta["shard"]), int(reply.meta["offset"])
            if self._reader is not None:
                self._reader.start(self._shard, self._offset)
        if self.inner_state == "reset":
            self.optim.state.clear()  # a fresh inner optimizer: its moments start from zero, as a new one's would

    @torch.no_grad()
    def rejoin_alone(self) -> None:
        """A node coming back after being down: its unsent round is lost; it asks the server for the global model
        (an empty request, the model back) and starts a round from it. Nobody else waits."""
        msg.send(torch.zeros(0, dtype=self._start.dtype), msg.SERVER, tag=JOIN)
        self._begin_task(msg.recv(src=msg.SERVER))

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
        updates applied by then; local_steps, the inner steps in them (the papers' total local updates). Loss
        against any: `exogym plot --x sim_time_s`, `--x updates` or `--x local_steps`."""
        if self.server is None:
            return {"sim_time_s": msg.now(), "updates": self._version}
        version, steps = msg.read_server(lambda s: (s.version, s.local_steps))
        return {"sim_time_s": msg.now(), "updates": version, "local_steps": steps}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        state["local"].update(start=self._start.clone(), version=self._version, steps=self._steps, H=self._H,
                              round_began=self._round_began, stopped=self._stopped, shard=self._shard,
                              offset=self._offset)
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        local = state["local"]
        self._start = local["start"].clone()
        self._version, self._steps, self._H = local["version"], local["steps"], local["H"]
        self._round_began, self._stopped = local["round_began"], local["stopped"]
        self._shard, self._offset = local["shard"], local["offset"]
        if self._reader is not None:
            self._reader.start(self._shard, self._offset + self._steps)
        if isinstance(self.scheduler, ShardLR):
            self.scheduler.at(self._offset + self._steps)
