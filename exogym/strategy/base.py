"""The Strategy base class.

A strategy owns a node's optimizer(s) and decides when and what the nodes communicate.
Each node gets its own deep copy of the strategy the user passed; `setup(model, context)` binds the
copy to that node's model and tells it the run's facts (exogym.strategy.context.NodeContext).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Mapping

import torch

from exogym._validation import check_number, init_keywords, reject_unknown_kwargs
from exogym.strategy.context import NodeContext
from exogym.strategy.lr_schedule import LRSchedule
from exogym.comm.mean import mean_
from exogym.adapters import Adaptable
from exogym.strategy.optim import OptimSpec, ensure_optim_spec

__all__ = ["Strategy", "NodeContext", "parameter_state", "frozen_state", "trainable_parameters",
           "strategy_keywords"]


def strategy_keywords(cls: type) -> list[str]:
    """The keywords a strategy class handles itself (its constructors'): the rest of a constructor's keywords are
    options of its optimizer (the name form, "sgd", momentum=0.9)."""
    return init_keywords(cls)


class Strategy(metaclass=Adaptable):
    """Base class: LR schedule, gradient clipping, step counting, the state protocol, and the hooks a node calls.

    Subclasses pass `optim_spec=` to this constructor or set `self.optim_spec` in `__init__` (then
    `self.optim`, alias `self.optimizer`, is built for them in `_init_node`) or build their own optimizer
    in `_init_node` (the LR schedule is then built over it after `_init_node`, or when the subclass calls
    `build_scheduler()` there), and implement `step()`, ending with `super().step()` (which advances the LR
    schedule and the step count). Helpers for `step()`:
    `communicate_gradients()` (average the gradients), `communicate_models()` (average the parameters),
    `update_parameters()` (clip, then the optimizer step).

    What a node calls, in order: `setup(model, context)` once; per step `skip_compute()`, `zero_grad()`,
    the forward/backward, `current_lr()`, `step()`; `finish()` after the last step. Around them, the state
    protocol: `state_dict()` / `load_state_dict()` (checkpoints, nodes coming up), `global_state()` and
    `model_sources()` (the global model), `joined()` (a node that came up). A strategy whose nodes run apart
    (messages, a server) also answers `rejoins_alone` / `rejoin_alone()` (a node coming back brings itself up to
    date, nobody waiting), `clock_runs_while_down` and `validation_facts()`; a strategy with a server starts from
    `exogym.strategy.ServerStrategy`, which answers them all.

    Args:
        lr_scheduler: None (a constant lr), `"lambda_cosine"` (linear warmup, then constant or cosine decay to
            `min_lr_factor x lr`; setting `warmup_steps` or `cosine_anneal` selects it), `"cosine"` and
            `"constant"` (lambda_cosine with `cosine_anneal` True / False), a torch LRScheduler class built with
            `lr_scheduler_kwargs`, or a callable `f(optimizer)`.
        lr_scheduler_kwargs: The scheduler's options: a torch LRScheduler class's keywords, or lambda_cosine's
            (`warmup_steps`, `cosine_anneal`, `min_lr_factor`).
        warmup_steps: lambda_cosine's linear warmup length, in steps.
        cosine_anneal: lambda_cosine: decay by a cosine after the warmup (True) or stay constant (False).
        min_lr_factor: lambda_cosine: the cosine decays to this fraction of lr.
        max_norm: Clip the global gradient norm of the node's parameters to this before each step.
        optim_spec: The optimizer a subclass has built for it (an OptimSpec, a name or an optimizer class).
        **unknown: Refused: an unknown keyword is a TypeError naming the accepted ones.

    Raises:
        TypeError: An unknown keyword, or an argument of the wrong type.
        ValueError: An unknown scheduler name, or a value out of range.
    """

    supports_membership_changes = True  # False: the strategy cannot run with failures or an elastic pool
    # Entries of state_dict() that are the same on every node by construction (DDP's optimizer state):
    # they go into its "global" part, the rest into "local".
    global_keys: frozenset[str] = frozenset()
    # The sim backend checks that the members of a collective issued it at the same step (an async call counts at
    # the step it was issued). False: this strategy's nodes meet at different steps on purpose.
    collectives_match_steps = True
    # True: the strategy's nodes talk by point-to-point messages (exogym.comm.messages): the run has the server
    # role, and a sim run over several processes keeps its one event queue in the process holding node 0
    # (exogym.backends.sim.postlink); undeclared, such a run stops at its first message, telling you to set it.
    sends_messages = False

    def __new__(cls, *args: Any, **kwargs: Any):
        # Keep the constructor arguments, so a run's config.json can say exactly how the strategy was built.
        self = super().__new__(cls)
        self._init_args = (args, kwargs)
        return self

    def config(self) -> dict[str, Any]:
        """The constructor arguments (given and default) this strategy was built with."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        bound = inspect.signature(type(self).__init__).bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        out: dict[str, Any] = {"name": type(self).__name__}
        for name, value in list(bound.arguments.items())[1:]:
            if isinstance(value, dict) and bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out

    @property
    def ignored_settings(self) -> dict[str, dict[str, Any]]:
        """The constructor keywords that had no effect (dropped by an argument adapter): {name: {"value", "reason"}}."""
        return {k: {"value": v, "reason": why} for k, (v, why) in getattr(self, "_ignored", {}).items()}

    def _keep_ignored_settings(self, ignored: Mapping[str, tuple[Any, str]]) -> None:
        # Called by the metaclass (exogym.adapters.Adaptable) right after construction.
        self._ignored = dict(ignored)

    def __init__(self, lr_scheduler: str | type | Callable[..., Any] | None = None,
                 lr_scheduler_kwargs: Mapping[str, Any] | None = None, *, warmup_steps: int | None = None,
                 cosine_anneal: bool | None = None, min_lr_factor: float | None = None,
                 max_norm: float | None = None, optim_spec: OptimSpec | str | type | None = None, **unknown: Any):
        if _built_in(type(self)):
            reject_unknown_kwargs(type(self).__name__, unknown, init_keywords(type(self)))
        if optim_spec is not None:
            self.optim_spec = ensure_optim_spec(optim_spec)
        self.lr_schedule = LRSchedule.parse(lr_scheduler, lr_scheduler_kwargs, warmup_steps=warmup_steps,
                                            cosine_anneal=cosine_anneal, min_lr_factor=min_lr_factor)
        check_number("max_norm", max_norm, positive=True, allow_none=True)
        self.max_norm = max_norm
        self.scheduler = None
        self.lr_callbacks: list[Callable[[float], Any]] = []  # called on node 0 with the next step's lr
        self._keep_extra_keywords(unknown)

    def _keep_extra_keywords(self, extra: Mapping[str, Any]) -> None:
        """A strategy of your own keeps the keywords its constructor passed on to Strategy.__init__ as attributes
        (EveryH(H=2).H == 2), as the original EXO Gym did; one that would replace what the strategy already has (a
        method, a property, an attribute set before) is refused. The built-in strategies refuse unknown keywords."""
        taken = sorted(k for k in extra
                       if k in self.__dict__ or _behaviour(inspect.getattr_static(type(self), k, None)))
        if taken:
            raise TypeError(f"{type(self).__name__} got {', '.join(f'{k}=' for k in taken)}, which would replace what "
                            f"a strategy already has ({', '.join(taken)}); give your setting another name")
        for name, value in extra.items():
            setattr(self, name, value)

    # ---- the node contract -------------------------------------------------------------------
    def setup(self, model: torch.nn.Module, context: NodeContext) -> None:
        """Bind this node's copy of the strategy to its model, once, before the first step.

        A resumed or joining node then loads its state with `load_state_dict`.

        Args:
            model: This node's model.
            context: What the backend tells the node: its rank, the node count, the run's length and shard size, and
                the store for state kept once (`NodeContext`).

        Raises:
            TypeError: A subclass's `__init__` did not call `super().__init__()`, or built no optimizer.
        """
        name = type(self).__name__
        self.check_constructed()
        self.context = context
        self._init_node(model, context.rank, context.num_nodes)
        if getattr(self, "optim", None) is None:
            fix = (f"set self.optim_spec in {name}.__init__ (e.g. OptimSpec(torch.optim.AdamW, lr=1e-3)) or build "
                   "self.optim in _init_node")
            if self.lr_schedule is not None:
                raise TypeError(f"{name} has an lr_scheduler but no self.optim after _init_node; {fix}")
            if type(self).zero_grad is Strategy.zero_grad:  # the default zero_grad and step need one
                raise TypeError(f"{name} has no optimizer (self.optim) after _init_node; {fix}")
        self.build_scheduler()

    def build_scheduler(self) -> None:
        """Build the LR schedule over `self.optim`, once: setup() calls it after _init_node; a subclass that builds
        its optimizer in _init_node may call it there itself (a later call changes nothing)."""
        if self.lr_schedule is None or self.scheduler is not None:
            return
        if getattr(self, "optim", None) is None:
            raise TypeError(f"{type(self).__name__} has an lr_scheduler but no self.optim yet; build self.optim "
                            "before the LR schedule")
        self.scheduler = self.lr_schedule.build(self.optim, max_steps=self._context().max_steps)

    def check_constructed(self) -> None:
        """Trainer.fit asks before any node starts: a subclass that skipped Strategy.__init__ cannot run."""
        if not hasattr(self, "lr_schedule"):
            name = type(self).__name__
            raise TypeError(f"{name} was built without running Strategy.__init__: call super().__init__(...) "
                            f"in {name}.__init__ (it sets up the LR schedule, max_norm and the step count)")

    def check_nodes(self, num_nodes: int) -> None:
        """Check the strategy's settings against the run's node count, before any node starts.

        Trainer.fit asks with the run's node count: a strategy whose settings must fit it (FedAvg's island_size)
        overrides this and raises an error naming both numbers, instead of failing in a running node. Nothing to
        check by default.

        Args:
            num_nodes: The run's node count.

        Raises:
            ValueError: In a subclass, when its settings cannot work with `num_nodes`.
        """

    def check_length(self, num_nodes: int, max_steps: int) -> None:
        """Check the strategy's settings against the run's length, before any node starts.

        Trainer.fit asks once it knows how many steps the run takes: a strategy whose settings the run could never
        act on (FedBuff's buffer_size larger than every update the nodes can send) raises an error naming the
        numbers, instead of running to the end without a word. Nothing to check by default.

        Args:
            num_nodes: The run's node count.
            max_steps: The run's steps.

        Raises:
            ValueError: In a subclass, when its settings cannot act in a run of this length.
        """

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        """Bind to one node (the original ExoGym hook; subclasses extend it and call super())."""
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        self.local_step = 0
        if getattr(self, "optim_spec", None) is not None:
            self.optim_spec = ensure_optim_spec(self.optim_spec)
            self.optim = self.optim_spec.build(model)

    @property
    def max_steps(self) -> int:
        """The run's length in steps (known from `setup()` on)."""
        return self._context().max_steps

    @property
    def steps_per_epoch(self) -> int:
        """Steps in one pass over this node's shard (known from `setup()` on)."""
        return self._context().steps_per_epoch

    @property
    def shard_size(self) -> int:
        """This node's number of training examples (known from `setup()` on)."""
        return self._context().shard_size

    def _context(self) -> NodeContext:
        context = getattr(self, "context", None)
        if context is None:
            raise AttributeError(f"{type(self).__name__} is not bound to a node yet: the run's facts (max_steps, "
                                 "steps_per_epoch, shard_size) are known from setup() on, not in __init__")
        return context

    def zero_grad(self) -> None:
        """Zero the gradients of the node's (inner) optimizer before the step's forward/backward."""
        self.optim.zero_grad()

    def skip_compute(self) -> bool:
        """True: this node sits out the coming step (no data to the device, no forward, no backward;
        FedAvg's unsampled clients). The node still calls step(), which must still join whatever
        collectives the step's schedule has. Asked once per step, before zero_grad(); no collectives here."""
        return False

    def step(self) -> None:
        """Subclasses communicate and update, then call this: it advances the LR schedule and the step count."""
        if self.scheduler is not None:
            self.scheduler.step()
        self.local_step += 1
        self._lr_stepped()

    def _lr_stepped(self) -> None:
        """After the LR schedule stepped: node 0 hands the next step's lr to each of lr_callbacks (the original's
        hook, which its loggers used)."""
        if self.scheduler is not None and getattr(self, "rank", 0) == 0:
            for callback in self.lr_callbacks:
                callback(self.current_lr())

    def finish(self) -> None:
        """Called on every node up after its last step, before the final validation: a strategy whose global
        model lags its nodes (DiLoCo between rounds) synchronises once more here."""

    def current_lr(self) -> float:
        """The learning rate of the node's (inner) optimizer for its next step."""
        optim = getattr(self, "optim", None)
        return float(optim.param_groups[0]["lr"]) if optim is not None else float("nan")

    # ---- the state protocol ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """This node's strategy state, tensors and plain data only: {"global": entries the same on every node
        by construction, "local": this node's own}. The default: the step count, the optimizer and the LR
        schedule (a strategy with more state extends both methods, calling super())."""
        optim = getattr(self, "optim", None)
        entries = {"step": self.local_step, "optim": optim.state_dict() if optim is not None else None,
                   "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        return {"global": {k: v for k, v in entries.items() if k in self.global_keys},
                "local": {k: v for k, v in entries.items() if k not in self.global_keys}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore what `state_dict()` returned (after `setup()`; exact, for checkpoints and nodes coming up).

        Args:
            state: `{"global": ..., "local": ...}` as `state_dict()` returned it.
        """
        entries = {**state["global"], **state["local"]}
        self.local_step = entries["step"]
        if entries["optim"] is not None:
            self.optim.load_state_dict(entries["optim"])
        if entries["scheduler"] is not None:
            self.scheduler.load_state_dict(entries["scheduler"])

    def joined(self) -> None:
        """On a node coming up, after it loaded a survivor's state: drop what was that survivor's own
        (unsent residuals, corrections in flight). Nothing by default."""

    def global_state(self) -> Mapping[str, torch.Tensor] | None:
        """State-dict entries of the global model that are equal on every node by construction (DDP's
        replicated parameters, DiLoCo's outer parameters); the rest of the global model is the average over
        model_sources(). The default: the frozen parameters (requires_grad=False, which no strategy changes or
        sends), so the global model holds them bit for bit; the rest is the average of the nodes' models."""
        return frozen_state(self.model) or None

    # ---- what the engine asks a strategy whose nodes run apart (messages, a server) ----------------------------
    @property
    def rejoins_alone(self) -> bool:
        """Whether a node coming back after being down (failures, an elastic pool) brings itself up to date by
        itself, in `rejoin_alone()`, with nobody else waiting; False: the nodes up hand it their state (a collective
        every node up takes part in, at the step it comes back). The same on every node. By default: whether the
        class overrides `rejoin_alone`; override this where it depends on settings (gossip's mode)."""
        return type(self).rejoin_alone is not Strategy.rejoin_alone

    def rejoin_alone(self) -> None:
        """On a node coming back, when `rejoins_alone`: take the global state by messages (ask the server for its
        model; take what arrived while down). Called before the step it comes back at, instead of the hand-over.

        Raises:
            NotImplementedError: `rejoins_alone` is True but the class does not say how.
        """
        raise NotImplementedError(f"{type(self).__name__}.rejoins_alone is True: define rejoin_alone() to bring a "
                                  "node coming back up to date")

    @property
    def clock_runs_while_down(self) -> bool:
        """Whether a node's simulated clock moves on while it is down (it spends its steps idle and comes back at
        its own time: the asynchronous strategies); False (the default): a node coming back takes the others' time
        from the collectives that bring it up to date."""
        return False

    def validation_facts(self) -> dict[str, float]:
        """What node 0's validation rows add, read when it validates (`exogym plot --x` can use each key): e.g.
        `sim_time_s`, node 0's clock, and `updates`, the server's updates applied by then (ServerStrategy gives
        both). Nothing by default (the rows then hold the step)."""
        return {}

    def check_data(self, node_batches: list[Any], *, processes: int) -> None:
        """Before any node starts (fit asks, once the data and the processes are known): refuse data the strategy's
        options cannot use. Accepts everything by default.

        Args:
            node_batches: Every node's NodeBatches.
            processes: The processes the run spans.
        """

    def read_batches(self, batches: Any, from_step: int) -> Iterator[Any]:
        """The node's batches, one per step, from `from_step` (the engine draws one every step): the node's own
        shard in order by default; a strategy that chooses each task's data (shard sampling) overrides it.

        Args:
            batches: The node's NodeBatches.
            from_step: The first step the node runs.

        Returns:
            An iterator of batches.
        """
        return batches.iterate(from_step=from_step)

    def model_sources(self, candidates: list[int], steps_done: int) -> list[int]:
        """Which nodes' average is the rest of the global model (all of `candidates` by default).

        Args:
            candidates: The nodes up, or those that were up before nodes came up.
            steps_done: The steps done so far.

        Returns:
            Among `candidates`, the ones whose average is the rest of the global model after `steps_done` steps.
        """
        return list(candidates)

    # ---- helpers for subclasses --------------------------------------------------------------
    def _clip_grads(self) -> None:
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The node's optimizer: the original documents' name for self.optim."""
        return self.optim

    @optimizer.setter
    def optimizer(self, value: torch.optim.Optimizer) -> None:
        self.optim = value

    @torch.no_grad()
    def communicate_gradients(self) -> None:
        """Average every gradient over the nodes that are up: one all-reduce per dtype (DDP's exchange).
        Bytes per node: 2 (K-1)/K x the gradients' bytes. Call it on every node in the same step."""
        if self.num_nodes > 1:
            mean_([p.grad for p in self.model.parameters() if p.grad is not None])

    @torch.no_grad()
    def communicate_models(self) -> None:
        """Average the trainable floating-point parameters over the nodes that are up (model averaging, FedAvg's
        exchange): one all-reduce per dtype, 2 (K-1)/K x their bytes per node (frozen parameters, the same on every
        node, are not sent). Call it on every node together."""
        if self.num_nodes > 1:
            mean_([p.data for p in trainable_parameters(self.model) if p.is_floating_point()])

    def update_parameters(self) -> None:
        """Clip the gradients (max_norm) and take the optimizer step: the local update after communicating."""
        self._clip_grads()
        self.optim.step()


def _built_in(cls: type) -> bool:
    """A strategy class of this library (its unknown keywords are errors), not one of your own."""
    return cls.__module__.split(".")[0] == "exogym"


def _behaviour(attr: Any) -> bool:
    """A class attribute that is behaviour (a method, a property), not a value a keyword may set."""
    return inspect.isroutine(attr) or isinstance(attr, (property, classmethod, staticmethod))


def parameter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict entries that are parameters (tied weights under each of their names)."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a strategy communicates: those with requires_grad. Frozen ones (requires_grad=False) are the
    same on every node and stay so: no strategy sends them."""
    return [p for p in model.parameters() if p.requires_grad]


def frozen_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict entries that are frozen parameters (requires_grad=False)."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.nn.Parameter) and not v.requires_grad}
