"""Data and models that fail on purpose at a chosen node and step, for the tests of how a run ends (importable by
the processes a run over several processes starts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch
from torch.utils.data import Dataset, TensorDataset

from toy import make_classification


class NanOnNode:
    """A dataset factory: every node gets its own 64 examples; node `rank`'s examples [first, last) (its training data,
    or with val=True its validation data) are nan. With shuffle=False and batch_size 16, examples 16-31 are step 2's."""

    def __init__(self, rank: int, first: int = 16, last: int = 32, val: bool = False):
        self.rank, self.first, self.last, self.val = rank, first, last, val

    def __call__(self, rank: int, num_nodes: int, is_val: bool) -> TensorDataset:
        x, y = make_classification(64, seed=rank).tensors
        if rank == self.rank and is_val == self.val:
            x = x.clone()
            x[self.first:self.last] = float("nan")
        return TensorDataset(x, y)


class FailAt(Dataset):
    """256 examples; reading example `index` raises (fail="raise": a RuntimeError, "diskfull": a DiskFullError) or
    sends this process a signal ("SIGTERM", "SIGINT", "SIGKILL", "SIGSTOP") once. With shuffle=False and one node, example 16 * (s - 1) is step s's first."""

    def __init__(self, index: int, fail: str = "raise", pid: int | None = None):
        self.data = make_classification(256)
        self.index, self.fail, self.sent = index, fail, False
        self.pid = pid  # whom the signal goes to (default: the process reading the example)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == self.index and self.fail == "raise":
            raise RuntimeError(f"example {i} cannot be read")
        if i == self.index and self.fail == "diskfull":
            from exogym.runs.disk import DiskFullError
            raise DiskFullError(f"no space left to write example {i}'s copy", "example.bin", needed=100, free=0)
        if i == self.index and not self.sent:
            self.sent = True
            if self.fail == "SIGSTOP" and self.pid is None:
                end_when_asked(os.getpid())
            os.kill(self.pid or os.getpid(), getattr(signal, self.fail))
            if self.pid is not None:  # signalled another process: wait here until it stops this one, so that no
                time.sleep(60)        # node can get past the step this one is in
        return self.data[i]


_END_WHEN_ASKED = """
import os, signal, sys, time
pid, term = int(sys.argv[1]), 1 << (signal.SIGTERM - 1)
while True:
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        sys.exit()
    if any(int(line.split()[1], 16) & term for line in status.splitlines() if line.startswith(("SigPnd", "ShdPnd"))):
        os.kill(pid, signal.SIGKILL)
        sys.exit()
    time.sleep(0.2)
"""


def end_when_asked(pid: int) -> None:
    """A stopped process cannot act on SIGTERM: a watcher kills it once one is pending, as torchrun does 30 s later
    (and a local launch 3 s later), so that a test of a stopped process does not wait for that. Linux (/proc)."""
    if os.path.exists(f"/proc/{pid}/status"):
        subprocess.Popen([sys.executable, "-c", _END_WHEN_ASKED, str(pid)], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class SqrtLoss(torch.nn.Module):
    """loss = sqrt(mean((x @ w)^2)): 0 for a batch of zeros, where its gradient is nan (inf times 0): a nan gradient
    behind a finite loss."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((8, 1), 0.1))

    def forward(self, batch):
        x, _ = batch
        return ((x @ self.w) ** 2).mean().sqrt()


class ZeroOnNode(NanOnNode):
    """As NanOnNode, but the chosen examples are 0 (SqrtLoss is then 0 with a nan gradient)."""

    def __call__(self, rank: int, num_nodes: int, is_val: bool) -> TensorDataset:
        x, y = make_classification(64, seed=rank).tensors
        if rank == self.rank and is_val == self.val:
            x = x.clone()
            x[self.first:self.last] = 0.0
        return TensorDataset(x, y)


class NanWhenEvaluatedLater(torch.nn.Module):
    """Training pushes `gate` down by lr x 10 per step (its loss term is 10 x gate, always finite); evaluation adds
    log(gate), which is nan once gate is negative: with SGD lr 0.05, from step 3 on."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 3)
        self.gate = torch.nn.Parameter(torch.ones(()))

    def forward(self, batch):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return loss + 10 * self.gate if self.training else loss + torch.log(self.gate)


class FailOnNode:
    """A dataset factory: node `rank` gets FailAt(index, fail, pid), the others 256 plain examples of their own (with
    `others_seed`, those of that seed, which FailAt's are with 0)."""

    def __init__(self, rank: int, index: int, fail: str = "raise", pid: int | None = None,
                 others_seed: int | None = None):
        self.rank, self.index, self.fail, self.pid, self.others_seed = rank, index, fail, pid, others_seed

    def __call__(self, rank: int, num_nodes: int, is_val: bool) -> Dataset:
        if rank == self.rank and not is_val:
            return FailAt(self.index, self.fail, self.pid)
        return make_classification(256, seed=rank if self.others_seed is None else self.others_seed)


class StuckInNativeCode:
    """A strategy mixin: node `stuck_rank` waits forever in a torch future (a C++ wait that no signal ends) at step
    `stuck_step`, instead of stepping."""

    stuck_rank, stuck_step = 1, 7

    def step(self):
        if self.rank == self.stuck_rank and self.local_step + 1 == self.stuck_step:
            torch.futures.Future().wait()
        super().step()
