"""FedBuff: asynchronous federated averaging through a buffer of K updates."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from exogym._validation import caller_level, check_int, check_number
from exogym.comm import messages as msg
from exogym.comm.messages import Message
from exogym.strategy.optim import OptimSpec
from exogym.strategy.server_rounds import FlatServer, ServerRoundsStrategy

__all__ = ["FedBuffStrategy", "FedBuffServer"]


class FedBuffServer(FlatServer):
    """theta, and a buffer of staleness-weighted pseudo-gradients: each arrival adds w(tau) Delta to it; the K-th
    applies theta <- theta - server_lr * (buffer / K) and empties it (one server update, the version moves by 1).
    w(tau) = (1 + tau)^-1/2 (FedBuff's weighting) or 1."""

    def __init__(self, theta: torch.Tensor, num_nodes: int, *, H: int, buffer_size: int, server_lr: float,
                 staleness: str, **options: Any):
        super().__init__(theta, num_nodes, H, **options)
        self.K, self.lr, self.rule = buffer_size, server_lr, staleness
        self.buffer = torch.zeros_like(self.theta)
        self.buffered: list[tuple[int, int, float]] = []  # (node, staleness, weight) of the updates in the buffer

    def apply(self, message: Message, staleness: int) -> None:
        weight = 1.0 if self.rule == "constant" else (1.0 + staleness) ** -0.5
        self.buffer.add_(message.tensor.to(self.theta.dtype), alpha=weight)
        self.buffered.append((message.src, staleness, weight))
        if len(self.buffered) < self.K:
            return
        self.theta.sub_(self.buffer, alpha=self.lr / self.K)
        self.buffer.zero_()
        self.version += 1
        nodes, taus, weights = zip(*self.buffered)
        self.buffered = []
        self.record_update(node=message.src, staleness=max(taus), weight=sum(weights) / self.K, quorum=self.K,
                           version=self.version)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "buffer": self.buffer.clone(), "buffered": list(self.buffered)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.buffer.copy_(state["buffer"])
        self.buffered = list(state["buffered"])


class FedBuffStrategy(ServerRoundsStrategy):
    """FedBuff: clients send updates to a server that buffers them and steps every K arrivals.

    Each node (client) takes H local steps from the global model it last received and sends its update Delta
    (the global model it started from minus its parameters) to the server, then continues from the server's
    current model. The server adds each arrival, weighted by 1/sqrt(1 + staleness), to a buffer; every K
    arrivals it moves the global model by server_lr times the buffer's mean and empties it. Fast clients
    contribute more often; nobody waits.

    Paper: Nguyen, Malik, Zhan et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022.
    What follows its Algorithm 1: Q local steps per client update, the buffer of K staleness-weighted updates, the
    weight 1/sqrt(1 + staleness) and the server step by server_lr times the buffer's mean. This project's reading
    where the paper leaves room: staleness counts server updates (buffer flushes) since the client's model was
    sent; every node is a client that is always training (the paper's concurrency is the node count, with no client
    sampling); a client gets the global model as it stands at once, its update possibly still waiting in the
    buffer; a buffer left short of K at the end of the run is not applied; "constant" weighting is an option of ours.
    The asynchronous Local-SGD framework's task options (`dynamic_local_updates`, `shard_sampling`, `inner_state`;
    ServerRoundsStrategy) come from Liu et al. 2024, not from FedBuff.

    Bytes per update: a node uploads M bytes (the trainable parameters, + 24 bytes of meta) and downloads M (+16)
    per round of H steps; one server update takes K uploads.

    Args:
        optim_spec: The local optimizer (default SGD, lr 0.01).
        H: Local steps per round (the paper's Q).
        lr: The local optimizer's learning rate.
        buffer_size: K, the arrivals per server update.
        server_lr: The server's step on the buffer's mean (1.0: FedAvg's averaging).
        staleness: `"sqrt"` (w = (1 + tau)^-1/2, the paper's) or `"constant"`.
        max_norm: Clip each local step's gradient norm.
        time_budget_s: A node sits out its remaining steps once its clock (simulated seconds, or the run's
            seconds without a time model) reaches this (fast nodes then train more steps than slow ones in the same
            time; None: every node trains max_steps).
        **kwargs: The task options `dynamic_local_updates`, `min_local_steps`, `shard_sampling`, `shard_seed`,
            `shard_steps`, `inner_state` (ServerRoundsStrategy); and the Strategy's options (`lr_scheduler`, ...).

    Raises:
        ValueError: H or buffer_size below 1, server_lr not positive, an unknown staleness rule.
    """

    _default_inner = OptimSpec(torch.optim.SGD, lr=0.01)

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, H: int = 10, lr: float | None = None,
                 buffer_size: int = 2, server_lr: float = 1.0, staleness: str = "sqrt",
                 time_budget_s: float | None = None, max_norm: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, H=H, lr=lr, time_budget_s=time_budget_s, max_norm=max_norm, **kwargs)
        check_int("buffer_size", buffer_size, minimum=1)
        check_number("server_lr", server_lr, positive=True, finite=True)
        if staleness not in ("sqrt", "constant"):
            raise ValueError(f"staleness must be 'sqrt' or 'constant', got {staleness!r}")
        self.buffer_size, self.server_lr, self.staleness = buffer_size, server_lr, staleness

    def check_length(self, num_nodes: int, max_steps: int) -> None:
        """The nodes send at most ceil(max_steps / H) updates each: a buffer larger than all of them never fills.

        Args:
            num_nodes: The run's node count.
            max_steps: The run's steps.

        Raises:
            ValueError: buffer_size is more than every update the run's nodes can send.
        """
        most = num_nodes * -(-max_steps // self.H)
        if self.buffer_size > most:
            raise ValueError(f"buffer_size={self.buffer_size} arrivals per server update, but this run's nodes send "
                             f"at most {most} updates (num_nodes={num_nodes} x ceil(max_steps={max_steps} / "
                             f"H={self.H})): the server would never update; use buffer_size <= {most}, or a longer "
                             "run, more nodes or a smaller H")

    def finish(self) -> None:
        """As ServerRoundsStrategy's; then node 0 says once when the buffer never filled (failures or a time budget
        left fewer updates than buffer_size): the run's global model is its start."""
        super().finish()
        if self.rank == 0 and self.server is not None:
            version, buffered = msg.read_server(lambda s: (s.version, len(s.buffered)))
            if version == 0:
                warnings.warn(f"FedBuff's buffer_size={self.buffer_size} was never filled: the server applied 0 "
                              f"updates ({buffered} arrived; failures or time_budget_s left fewer than "
                              f"buffer_size), so the global model is the initial one; use a smaller buffer_size",
                              RuntimeWarning, stacklevel=caller_level())

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> FedBuffServer:
        """The run's server, made once where it runs.

        Args:
            theta: The global model's trainable parameters, flat.
            num_nodes: The run's node count.

        Returns:
            The FedBuff server.
        """
        return FedBuffServer(theta, num_nodes, H=self.H, buffer_size=self.buffer_size, server_lr=self.server_lr,
                             staleness=self.staleness, **self.server_options(num_nodes))
