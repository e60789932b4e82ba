"""TrainNode: one node's ordinary training loop (data shard -> forward -> backward -> strategy.step()).

The same loop runs as a thread under the sim backend and as a process under torch.distributed;
it talks to other nodes only through the strategy and the comm layer.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from exogym.cluster.spans import SpanLog
from exogym.runs.checkpoint import CheckpointError, CheckpointPlan, NodeState, finalize_checkpoint, save_node_state
from exogym.comm.transport import CollectiveError, Transport, bind_transport
from exogym.data.sharding import NodeBatches, batch_size_of, move_to_device, token_count
from exogym.engine.config import RunConfig
from exogym.engine.diagnostics import parameter_divergence
from exogym.engine.execution import Execution, SequentialExecution
from exogym.engine.forward_backward import accumulate, minibatches
from exogym.engine.global_model import global_state_dict
from exogym.engine.model_call import contract_error, model_caller, parse_model_output
from exogym.runs.record import LiveLog, NodeLog
from exogym.engine.rejoin import hand_over_state
from exogym.engine.rng import GlobalRNGState
from exogym.strategy.context import KeepOnce, NodeContext, keep_once_per_node


__all__ = ["TrainNode", "parse_model_output", "NonFiniteLoss", "keep_completed_rows"]


@dataclass
class _StepRecord:
    """One step's measurements until the next flush (losses stay on the device until then)."""

    step: int  # optimizer steps done after it (from 1)
    loss: torch.Tensor | None  # None: the node sat the step out (down, or not sampled)
    metrics: dict[str, torch.Tensor]
    lr: float
    bytes_sent: int  # cumulative
    wall_time_s: float
    tokens: int  # cumulative
    sim_time_s: float


class NonFiniteLoss(FloatingPointError):
    """A loss is nan or inf: a node's training loss, or the validation loss.

    The message names where it first appeared: the run's earliest non-finite training loss over all nodes,
    once the run has gathered them; node 0 for validation.

    Args:
        message: What happened and where.
        rank: The node.
        step: The step.
        value: The loss (nan, inf or -inf).
        table: `"train"` or `"val"`.
    """

    def __init__(self, message: str, rank: int, step: int, value: float, table: str = "train"):
        super().__init__(message)
        self.rank, self.step, self.value, self.table = rank, step, value, table

    def __reduce__(self) -> tuple:  # crosses from a node's process to the caller intact
        return type(self), (str(self), self.rank, self.step, self.value, self.table)


class TrainNode:
    """Node `rank`: owns its model copy, strategy copy, data and log."""

    def __init__(self, rank: int, model: torch.nn.Module, strategy, batches: NodeBatches,
                 val_batches: list[Any] | None, device: torch.device, cfg: RunConfig, start_time: float,
                 live: LiveLog, *, resume: NodeState | None = None, checkpoints: CheckpointPlan | None = None,
                 execution: Execution | None = None, keep_once: KeepOnce = keep_once_per_node):
        self.rank, self.model, self.strategy = rank, model, strategy
        self.batches, self.val_batches = batches, val_batches
        self.device, self.cfg, self.start_time, self.live = device, cfg, start_time, live
        self.resume, self.checkpoints = resume, checkpoints
        self.log = resume.log if resume is not None else NodeLog(rank)
        self.step = 0
        self._unflushed: list[_StepRecord] = []  # the steps since the last flush
        self._step_flops: float | None = None
        self._measured_s = 0.0  # the last step's measured compute seconds (compute_time="measured")
        self._tokens = self.log.rows[-1].get("tokens", 0) if self.log.rows else 0
        self._eval_model: torch.nn.Module | None = None
        self._call = None  # how the model is called (model(batch) or model(**batch)), decided on the first batch
        self.execution = SequentialExecution() if execution is None else execution  # the backend's choice
        self.keep_once = keep_once  # the backend's store of state kept once for its nodes (NodeContext.keep_once)

    def run(self, comm: Transport) -> tuple[NodeLog, dict[str, torch.Tensor] | None]:
        """Train for cfg.max_steps; return this node's log and (node 0) the global model's state."""
        with bind_transport(comm):
            try:
                return self._train(comm)
            except Exception as e:
                if hasattr(e, "add_note") and not isinstance(e, (CollectiveError, NonFiniteLoss)):  # those name theirs
                    e.add_note(f"(raised in node {self.rank} at step {self.step + 1})")
                if not hasattr(e, "exogym_node"):
                    e.exogym_node = self.rank  # which node, for a run over several processes to report
                raise

    def _train(self, comm: Transport) -> tuple[NodeLog, dict[str, torch.Tensor] | None]:
        cfg, s = self.cfg, self.strategy
        first_step = self._start(comm)
        batches: Iterator[Any] = s.read_batches(self.batches, first_step)  # the strategy may choose each task's data
        if cfg.validate and first_step == 0:
            self._validate(comm, 0)  # the initial model's loss: every curve starts at step 0
        for self.step in range(first_step, cfg.max_steps):
            comm.step = self.step + 1  # steps count from 1 in records and messages
            spans = comm.clock.spans
            if spans is not None:
                spans.step = self.step + 1
            batch = next(batches)  # drawn even when the node sits out: its data position is a function of the step
            loss, metrics = None, {}  # a node that sits out the step logs no loss (and no compute time)
            if not self._up(self.step + 1):  # down: no compute, no collectives, until it comes up again
                if spans is not None:  # its idle time is down time until it computes again
                    spans.down = True
                self._pass_down_time(comm)
                self._record_step(comm, None, {}, s.current_lr())
                self._after_step(comm, self.step + 1)
                continue
            skip = s.skip_compute()
            s.zero_grad()
            if not skip:
                batch = move_to_device(batch, self.device)
                self._tokens += token_count(batch) or 0
                loss, metrics = self._timed_forward_backward(batch, comm)
            lr = s.current_lr()  # the rate this step uses, before the schedule advances
            s.step()
            if self.step + 1 == cfg.max_steps:
                s.finish()  # e.g. DiLoCo's last, shorter round: the global model includes every step
            self._record_step(comm, loss, metrics, lr)
            self._after_step(comm, self.step + 1)
        final = global_state_dict(self.model, s, comm, result=self.rank == 0)
        comm.close_messages()  # the torch backend's message threads end with the run (the sim's: nothing to do)
        self.log.comm = {"bytes_sent": comm.stats.bytes_sent, "payload_bytes": comm.stats.payload_bytes,
                         "bytes_by_op": dict(comm.stats.bytes_by_op), "calls_by_op": dict(comm.stats.calls_by_op)}
        if comm.stats.bytes_received:
            self.log.comm["bytes_received"] = comm.stats.bytes_received
        if cfg.time_model is not None:
            self.log.comm["sim_time"] = comm.clock.as_dict()
            if comm.clock.spans is not None:  # the timeline (exogym.runs.timeline)
                self.log.comm["timeline"] = comm.clock.spans.to_plain()
            if cfg.time_model.slowdowns is not None:  # the ones drawn while this node ran: the record lists them
                self.log.comm["slowdowns"] = [w.as_record() for w in
                                              cfg.time_model.slowdowns.during(self.rank, comm.clock.now)]
        links = comm.link_usage() if self.rank == 0 else None
        if links is not None:  # the sim's shared links (live: complete when the run's last flow has ended)
            self.log.comm["links"] = links
            self.log.comm["link_spans"] = comm.link_spans()  # their busy time, for the timeline's link lanes
        server = comm.served() if self.rank == 0 and hasattr(comm, "served") else None
        if server is not None:  # a strategy's server runs with node 0: its record goes with node 0's log
            self.log.comm["server"] = {"updates": server.updates, "bytes_sent": server.stats.bytes_sent,
                                       "bytes_received": server.stats.bytes_received,
                                       "messages": server.sent_log.to_plain()["messages"]}
        return self.log, (final if self.rank == 0 else None)

    def _record_step(self, comm: Transport, loss: torch.Tensor | None, metrics: dict[str, torch.Tensor],
                     lr: float) -> None:
        self._unflushed.append(_StepRecord(self.step + 1, loss, metrics, lr, comm.stats.bytes_sent,
                                           time.perf_counter() - self.start_time, self._tokens, comm.clock.now))

    def _up(self, step: int) -> bool:
        """Whether this node is up at `step`; a node coming up at `step` first takes the global state."""
        m = self.cfg.membership
        if m is None:
            return True
        if self.rank not in m.alive(step):
            return False
        joiners = m.joiners(step)
        if joiners and self.strategy.rejoins_alone:  # the strategy brings the joiner up to date itself; nobody waits
            if self.rank in joiners:
                self.strategy.rejoin_alone()
        elif joiners:  # every node up at this step takes part (some send, the joiners receive)
            self.execution.release(self.rank, self.model)  # a survivor's state is sent whole
            hand_over_state(self.model, self.strategy, step, list(m.survivors(step)), list(joiners))
        return True

    def _start(self, comm: Transport) -> int:
        """Bind the strategy to this node (or take it back from a checkpoint); return the first step to run."""
        cfg, s = self.cfg, self.strategy
        if self.val_batches is not None:
            self.val_batches = [move_to_device(b, self.device) for b in self.val_batches]
        self.model.to(self.device)
        if self.resume is not None:
            self.model.load_state_dict(self.resume.model)
        comm.match_steps = getattr(s, "collectives_match_steps", True)  # the sim pairs collectives by step too
        s.setup(self.model, NodeContext(rank=self.rank, num_nodes=cfg.num_nodes, max_steps=cfg.max_steps,
                                        steps_per_epoch=cfg.steps_per_epoch, shard_size=self.batches.shard_size,
                                        shard_sizes=cfg.shard_sizes, shard_steps=cfg.shard_steps,
                                        node_speeds=_relative_speeds(cfg.time_model),
                                        share_parameters=self.execution.share_parameters,
                                        keep_once=self.keep_once))
        first_step = 0
        if self.resume is not None:  # the strategy's state (optimizers and all), counts and clock, where they were
            try:
                s.load_state_dict(self.resume.strategy)
            except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
                # a changed file whose hash was written again, or another strategy's: named, not raised raw
                raise CheckpointError(f"node {self.rank}'s checkpointed strategy state does not load into "
                                      f"{type(s).__name__} ({type(e).__name__}: {e}); the file was changed after it "
                                      "was written, or is another run's: resume from an earlier checkpoint") from e
            comm.restore(self.resume.comm_stats, self.resume.clock)
            if "messages" in self.resume.strategy:
                comm.load_messages_state(self.resume.strategy["messages"])
            first_step = self.resume.step
        if cfg.time_model is not None and comm.clock.spans is None:  # a checkpoint's clock brings its own
            comm.clock.spans = SpanLog(t=[comm.clock.now])
        self.execution.adopt_optimizer(self.rank, self.model, getattr(s, "optim", None))
        self.model.train()
        return first_step

    def _after_step(self, comm: Transport, done: int) -> None:
        """What is due after `done` steps: validation, diagnostics, moving the log to the host, a checkpoint.
        Every node reaches the same decisions, since those with a collective need all of them."""
        cfg, last = self.cfg, done == self.cfg.max_steps
        if cfg.validate and (done % cfg.val_interval == 0 or last):
            self._validate(comm, done)
        if cfg.diagnostics_interval and (done % cfg.diagnostics_interval == 0 or last):
            row = {"step": done, **parameter_divergence(self.model, comm)}
            if self.rank == 0:
                self.log.diagnostics.append(row)
                self.live.add_row("diagnostics", row)
        save = self.checkpoints is not None and self.checkpoints.due(done, cfg.max_steps)
        if done % cfg.log_interval == 0 or last or save:
            self._flush()
        if save:
            self._save_checkpoint(comm, done)

    def _save_checkpoint(self, comm: Transport, done: int) -> None:
        # The global random streams are this node's own while it runs (the backend swapped them in).
        self.execution.release(self.rank, self.model)
        comm.pause_for_checkpoint()  # messages: the nodes meet in simulated time, so the checkpoint is a cut
        strategy_state = self.strategy.state_dict()
        messages = comm.messages_state()  # in flight, and the server's (one node keeps them)
        if messages is not None:
            strategy_state = {**strategy_state, "messages": messages}
        state = NodeState(done, self.model.state_dict(), strategy_state,
                          GlobalRNGState.capture(self.device).to_plain(), comm.stats, self.log, comm.clock)
        save_node_state(self.checkpoints, self.rank, state)
        comm.barrier(comm.world)  # every node's file is on disk before node 0 publishes the checkpoint
        if self.rank == 0:
            finalize_checkpoint(self.checkpoints, done)

    def _autocast(self):
        # bfloat16 everywhere: unlike float16 it needs no loss scaling (the trainer rejects devices without it).
        if not self.cfg.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _pass_down_time(self, comm: Transport) -> None:
        """A strategy whose nodes run on their own clocks (clock_runs_while_down) has a node that is down spend a
        step's compute time idle, so that it comes back at the time its step count says, not in the past. Other
        strategies' down nodes keep their clocks (their collectives realign them)."""
        model = self.cfg.time_model
        if model is None or not self.strategy.clock_runs_while_down:
            return
        comm.clock.sit_out(model.compute_seconds(self.rank, flops=self._step_flops or 0.0,
                                                 measured_s=self._measured_s))

    def _timed_forward_backward(self, batch: Any, comm: Transport) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward/backward, advancing the node's virtual clock by its compute time when time is simulated."""
        model = self.cfg.time_model
        count = model is not None and not model.measured and self._step_flops is None
        out, seconds, flops = self.execution.forward_backward(self, batch, count_flops=count,
                                                              measure=model is not None and model.measured)
        if flops is not None:
            self._step_flops = flops
        self._measured_s = seconds
        if model is not None:
            model.add_compute(self.rank, comm.clock, flops=self._step_flops or 0.0, measured_s=seconds)
        return out

    def forward_backward(self, batch: Any, model: torch.nn.Module | None = None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (and metrics) of the whole batch, with gradients accumulated over minibatches
        (exogym.engine.forward_backward). `model`: another copy to run (fused execution counts FLOPs on one);
        the node's own by default."""
        model = self.model if model is None else model
        parts = minibatches(batch, self.cfg.minibatch_size)

        def step(i: int, weight: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            with self._autocast():
                loss, metrics = parse_model_output(self._model_out(model, parts[i]))
            (loss if weight is None else loss * weight).backward()
            return loss, metrics

        return accumulate(parts, step)

    def _model_out(self, model: torch.nn.Module, batch: Any) -> Any:
        """model(batch), or model(**batch) for a dict batch whose keys are the forward's parameters."""
        if self._call is not None:
            return self._call(model, batch)
        call = model_caller(model, batch)
        try:
            out = call(model, batch)
        except TypeError as e:  # the first call: most likely a model that does not take the whole batch
            raise contract_error(batch, e) from e
        self._call = call
        return out

    def keep_completed_rows(self) -> None:
        """The run stopped (another node failed, a signal, a stuck node): the steps this node completed since its
        last flush go to its log and the live log, whatever their loss (a nan row is what was measured)."""
        self._flush(check=False)

    def _flush(self, check: bool = True) -> None:
        """Move the losses since the last flush to the host (one sync per log interval, not per step); a
        non-finite loss stops the run (check=False: kept as it is)."""
        computed = [u for u in self._unflushed if u.loss is not None]  # steps the node did not sit out
        names = list(computed[0].metrics) if computed else []
        losses = iter(_host_floats([u.loss for u in computed]))
        metrics = {n: iter(_host_floats([u.metrics[n] for u in computed])) for n in names}
        rows = []
        for u in self._unflushed:
            row: dict[str, float] = {"step": u.step}
            if u.loss is not None:
                loss = next(losses)
                if check and not math.isfinite(loss):
                    raise NonFiniteLoss(f"the training loss on node {self.rank} is {loss} at step {u.step}; "
                                        "lower the learning rate, set max_norm, or check the data",
                                        self.rank, u.step, loss)
                row.update(loss=loss, **{n: next(metrics[n]) for n in names})
            row["lr"] = u.lr
            if self.cfg.membership is not None:
                row["up"] = int(self.rank in self.cfg.membership.alive(u.step))
            if self._tokens:
                row["tokens"] = u.tokens
            row.update(bytes=u.bytes_sent, wall_time_s=u.wall_time_s)
            if self.cfg.time_model is not None:
                row["sim_time_s"] = u.sim_time_s
            rows.append(row)
        self._unflushed.clear()
        self.log.rows.extend(rows)
        self.live.add_rows(self.rank, rows)

    def _validate(self, comm: Transport, done: int) -> None:
        state = global_state_dict(self.model, self.strategy, comm, result=self.rank == 0)  # every node takes part
        if self.rank != 0:
            return
        if self._eval_model is None:
            self._eval_model = copy.deepcopy(self.model)
        self._eval_model.load_state_dict(state, strict=True)
        row: dict[str, float] = {"step": done}
        row.update(self.strategy.validation_facts())  # e.g. a server's: the simulated time, the updates applied
        for prefix, model in (("local", self.model), ("global", self._eval_model)):
            for name, value in self._evaluate(model).items():
                row[f"{prefix}_{name}"] = value
        self.log.val.append(row)
        self.live.add_row("val", row)
        bad = [k for k in ("local_loss", "global_loss") if not math.isfinite(row[k])]
        if bad:  # kept in the record above, then the run stops: a nan validation loss is no result
            values = ", ".join(f"{k} {row[k]}" for k in ("local_loss", "global_loss"))
            raise NonFiniteLoss(f"the validation loss is non-finite at step {done} ({values}; local: node 0's "
                                "model, global: the global model); check the validation data for nan/inf, or the "
                                "parameters (lower the learning rate, set max_norm)", 0, done, row[bad[0]], table="val")

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for batch in self.val_batches:
            n = batch_size_of(batch)
            with self._autocast():
                loss, metrics = parse_model_output(self._model_out(model, batch), training=False)
            values = {"loss": loss.detach().float(), **metrics}
            for k, v in values.items():
                sums[k] = v * n + sums.get(k, 0.0)
            count += n
        model.train(was_training)
        return {k: float(v) / count for k, v in sums.items()}


def _host_floats(scalars: list[torch.Tensor]) -> list[float]:
    """Scalar tensors as Python floats (via float32), in one transfer: log_interval=1 flushes one a step, which
    item() reads without stacking."""
    if len(scalars) == 1:
        return [scalars[0].float().item()]
    return torch.stack([t.float() for t in scalars]).tolist() if scalars else []


def _relative_speeds(time_model: Any) -> tuple[float, ...]:
    """Each node's compute speed by rank (a step's seconds are inversely proportional to it); () without a time
    model."""
    if time_model is None:
        return ()
    if time_model.measured:
        return tuple(time_model.node_speeds)
    return tuple(v * f for v, f in zip(time_model.node_speeds, time_model.device_flops))


def keep_completed_rows(nodes: Iterable[TrainNode]) -> None:
    """The run stopped: every node's steps completed since its last flush go to the live log (the record of what
    was trained). Whatever fails here (a full disk under the logger) must not hide why the run stopped."""
    for node in nodes:
        try:
            node.keep_completed_rows()
        except Exception:  # noqa: BLE001 - the rows that reached the live log before it are kept
            pass
