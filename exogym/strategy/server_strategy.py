"""The base of a strategy whose nodes talk to one server: the documented way to write one.

A subclass says how to make the server (`make_server`) and what its nodes do each step (`step`, with
`exogym.comm.send` / `recv`); the base answers what the engine asks of such a strategy:

- serving: every node declares the server in its setup, made once where it runs (`self.server`);
- the result: the model `fit` returns and validation's global rows take their trainable parameters from the
  server's model (`server_model`, read at node 0's clock), not from an average of the nodes;
- validation rows: `sim_time_s` (node 0's clock) and `updates` (the server's update rows by then), so
  `exogym plot --x updates` and `--x sim_time_s` work;
- the end: `finish()` meets once (a barrier), so every node's last message is in before the model is read;
- failures: a node down spends its steps idle and comes back at its own time (`clock_runs_while_down`); it is
  handed the nodes' state unless the subclass brings it up to date itself (`rejoin_alone`);
- checkpoints: the server's `state_dict()` / `load_state_dict()` are saved and restored with the messages in
  flight (they are also what a node in another process reads, so they hold whatever `server_model` reads), the
  strategy's own state with `Strategy.state_dict()`.
"""

from __future__ import annotations

from typing import Mapping

import torch

from exogym.comm import messages as msg
from exogym.comm.collectives import barrier
from exogym.strategy.base import Strategy, frozen_state, trainable_parameters

__all__ = ["ServerStrategy", "flat_parameters"]


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """The trainable parameters, concatenated (one dtype), detached, on the CPU.

    Args:
        model: The model.

    Returns:
        A flat tensor, in the order of `model.parameters()` (those with requires_grad).

    Raises:
        TypeError: the trainable parameters do not share one floating-point dtype.
    """
    params = trainable_parameters(model)
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"the server-based strategies send the trainable parameters as one flat tensor and need them "
                        f"to share one floating-point dtype; got {sorted(map(str, dtypes))}")
    return torch.cat([p.detach().reshape(-1).to("cpu") for p in params])


class ServerStrategy(Strategy):
    """A strategy whose nodes talk to one server (module docstring). Subclasses define `make_server` and `step`.

    The server holds the global model's trainable parameters as one flat tensor; by default `server.theta`
    (override `server_model` to read it elsewhere).

    Args:
        **kwargs (Any): The Strategy base's options (the inner optimizer `optim_spec`, the LR schedule, ...), as
            `Strategy` documents them.
    """

    sends_messages = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> msg.Server:
        """The run's server, made once where it runs (node 0's process), from node 0's starting model.

        Args:
            theta: The model's trainable parameters, flat (`flat_parameters`), as every node starts.
            num_nodes: The run's node count.

        Returns:
            A `exogym.comm.Server`.
        """
        raise NotImplementedError(f"{type(self).__name__} must define make_server(theta, num_nodes)")

    def server_model(self, server: msg.Server) -> torch.Tensor:
        """The global model's trainable parameters, flat, as the server holds them (`server.theta` by default).

        Args:
            server: The server (or, in another process, its copy as of this read).

        Returns:
            A flat tensor shaped as `flat_parameters(model)`.
        """
        return server.theta

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        # serve() calls make at once where the server is made, and not at all where it exists: one flat copy a run
        self.server = msg.serve(lambda: self.make_server(flat_parameters(model), num_nodes))

    def finish(self) -> None:
        """The nodes meet once, at the end, so every node's last message is in before the global model is read.
        A subclass sends its last round first, then calls this."""
        barrier()

    @property
    def clock_runs_while_down(self) -> bool:
        """A node down spends its steps idle and comes back at its own time: nobody waits for it."""
        return True

    def global_state(self) -> Mapping[str, torch.Tensor]:
        """The server's model as of this node's clock (read_server: on any node of any process), with the frozen
        parameters; the rest of the model's state (buffers) is the nodes' average."""
        theta = msg.read_server(lambda s: self.server_model(s).clone())
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        chunks = theta.split([p.numel() for _, p in params])
        return {**frozen_state(self.model),
                **{n: c.view_as(p).to(p.device, p.dtype) for (n, p), c in zip(params, chunks)}}

    def validation_facts(self) -> dict[str, float]:
        """node 0's clock (`sim_time_s`) and the server's update rows so far (`updates`: one per
        `Server.record_update`)."""
        return {"sim_time_s": msg.now(), "updates": msg.read_server(lambda s: len(s.updates))}
