"""A small checkpointed run that a fault-injection test stops at a chosen step (python fault_run.py KIND STEP
[LAUNCH]): node 1 reads its step-STEP batch and then raises, or sends its process SIGINT, SIGTERM, SIGKILL or
SIGSTOP; "node0-SIGSTOP": node 0 stops its own process instead (torchrun's rank 0); "caller-SIGKILL" (with LAUNCH
"processes"): it SIGKILLs the calling process. KIND "none" runs it whole, "resume" resumes logs/r whole. LAUNCH:
"one" (one process, the default), "processes" (fit(processes=2): node 1 in a process of its own), "torch"
(fit(backend="torch"): one process per node), "torchrun" (the script run by `python -m torch.distributed.run
--standalone --nproc-per-node 2`: node 1 in rank 1), or "torchrun-torch" (the same with backend="torch"). The run
writes logs/r/ in the working folder."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from exogym import Trainer  # noqa: E402
from exogym.backends.peer_watch import MIN_PEER_TIMEOUT  # noqa: E402
from exogym.strategy import DiLoCoStrategy  # noqa: E402
from exogym.strategy.optim import OptimSpec  # noqa: E402
from faulty import FailOnNode  # noqa: E402
from toy import TinyMLP  # noqa: E402

MAX_STEPS, CHECKPOINT_INTERVAL, BATCH = 30, 4, 16
# peer_timeout of the runs over several processes: a stopped process is named this soon (the shortest fit takes)
PEER_TIMEOUT = MIN_PEER_TIMEOUT
NODE_TIMEOUT = 120.0  # their node_timeout: far longer, so that a stopped process is named by the peer timeout


def fit(kind: str = "none", step: int = 0, **kwargs):
    if kind == "caller-SIGKILL":  # node 1 kills the calling process (its own waits to be ended with it)
        data = FailOnNode(1, BATCH * (step - 1), "SIGKILL", pid=os.getpid())
    elif kind.startswith("node0-"):  # node 0's process (torchrun's rank 0, which holds the run folder) is hit; both
        # nodes read what they read in the uninterrupted run (FailOnNode(1, -1): FailAt's examples on node 1, seed 0)
        data = FailOnNode(0, BATCH * (step - 1), kind.removeprefix("node0-"), others_seed=0)
    else:
        data = FailOnNode(1, BATCH * (step - 1), kind) if kind != "none" else FailOnNode(1, -1)
    trainer = Trainer(TinyMLP(dropout=0.1), data)
    strategy = DiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=0.01), H=3)
    kwargs.setdefault("checkpoint_interval", CHECKPOINT_INTERVAL)
    trainer.fit(strategy, 2, max_steps=MAX_STEPS, batch_size=BATCH, shuffle=False, progress=False, run_name="r",
                **kwargs)
    return trainer


def command(kind: str, step: int, launch: str = "one") -> list[str]:
    """The command line that runs this script with a fault, laid out as `launch` says."""
    if launch.startswith("torchrun"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                os.path.abspath(__file__), kind, str(step), launch]
    return [sys.executable, os.path.abspath(__file__), kind, str(step), launch]


def options(kind: str, launch: str = "one") -> dict:
    """fit's options for a run laid out as `launch` says (the command line's, or a test's run in its own process)."""
    options = {"processes": 2} if launch == "processes" else {}
    if launch != "one":  # caller-SIGKILL: the killing node waits in a sleep that node_timeout cuts short
        options.update(peer_timeout=PEER_TIMEOUT,
                       node_timeout=PEER_TIMEOUT if kind == "caller-SIGKILL" else NODE_TIMEOUT)
    if launch in ("torch", "torchrun-torch"):  # the torch backend: one node per process (fit's, or torchrun's)
        options["backend"] = "torch"
    return options


def resume(run: str = "logs/r", launch: str = "one"):
    """Resume `run` from its newest checkpoint, with no fault, in this process (launch: "one", "processes" or
    "torch"; a torchrun launch resumes through command("resume", 0, launch))."""
    return fit(resume_from=run, **options("resume", launch))


if __name__ == "__main__":
    torch.set_num_threads(1)
    launch = sys.argv[3] if len(sys.argv) > 3 else "one"
    if sys.argv[1] == "resume":  # from the run's newest checkpoint, with no fault
        resume(launch=launch)
    else:
        fit(sys.argv[1], int(sys.argv[2]), **options(sys.argv[1], launch))
