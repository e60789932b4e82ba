"""One simulation over several processes, against one process and against this machine's own limit.

Per cell (a model, K nodes, a strategy), each in a fresh process, wall time per step after a warm-up, measured
inside the run (so start-up, forking and the process group's rendezvous are reported apart):
- "1 proc, 1 thr": fit(processes=1) with one torch thread;
- "1 proc, 2 thr": fit(processes=1) with two;
- "2 procs": fit(processes=2), one thread each;
- "plain 2 procs": the limit of this machine and of gloo: two processes started by torch.multiprocessing, each
  keeping its K/2 model copies and optimizers in a Python loop, with one gloo all-reduce of the flattened sum per
  synchronisation (DDP: the gradients every step; DiLoCo: the parameters every H steps, then an outer Nesterov
  SGD step), no simulator at all.
Workloads: the 784-256-256-10 MLP and the small CNN of benchmarks/workload.py, batch 32 per node, and exogym's
small GPT (4 layers, width 128, 8 sequences x 64 tokens per node; --memory only), AdamW; DDP, and DiLoCo with H=10
(--memory also: gossip on a ring, H=10).
Ratios are to "1 proc, 1 thr" and, for "2 procs", to the plain loop.
--memory: per simulating process, 1 process against each of 2, two measures side by side (Linux):
- resident: its peak resident memory above that of an idle process which imported torch and exogym (measured the
  same way, in a fresh process);
- private: its peak private memory (USS: pages no other process maps, read from /proc/<pid>/smaps_rollup every
  20 ms), what the machine would get back if it exited. One process: above the private memory of an idle
  process which imported torch, torch._dynamo (which torch.optim imports on first use) and exogym. A process of
  2 was forked from a forkserver that imported those modules and shares them with it, so all its private memory
  counts (pages it inherited and wrote to included).
Usage: python benchmarks/bench_processes.py [--models mlp cnn] [--nodes 8 16 64] [--strategies ddp diloco]
       [--seconds 10]
       python benchmarks/bench_processes.py --memory [--models mlp cnn gpt] [--nodes 16 64]
       [--strategies ddp diloco gossip]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DistributedSampler

from workload import MLP, SmallCNN, make_data, make_tokens

MODES = ("1 proc, 1 thr", "1 proc, 2 thr", "2 procs", "plain 2 procs")
BATCH, H = 32, 10


def strategy(name: str):
    from exogym.strategy import DiLoCoStrategy, GossipStrategy, OptimSpec, SimpleReduceStrategy

    spec = OptimSpec(torch.optim.AdamW, lr=1e-3)
    if name == "gossip":  # messages between ring neighbours every H steps; the global model is the nodes' mean
        return GossipStrategy(spec, topology="ring", H=H)
    return SimpleReduceStrategy(spec) if name == "ddp" else DiLoCoStrategy(spec, H=H)


def workload(model: str, k: int, steps: int):
    """(the model, the training data for k nodes and `steps` steps, the batch per node)."""
    if model == "gpt":
        from exogym.models.gpt import GPT
        return GPT(65, 64, n_layer=4, n_head=4, n_embd=128), make_tokens(k * 8 * (steps + 1)), 8
    return (MLP if model == "mlp" else SmallCNN)(), make_data(k * BATCH * (steps + 1)), BATCH


def private_mb(pid: int | str = "self") -> float | None:
    """A process's private memory (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup) in MB; None when
    it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith("Private_")) / 2**10
    except OSError:
        return None


class PrivatePeak(threading.Thread):
    """Every 20 ms, the private memory of this process (`own`) or of its grandchildren (the processes a
    forkserver child of this one forked: the simulating processes); keeps each one's peak."""

    def __init__(self, own: bool):
        super().__init__(daemon=True)
        self.own, self.peaks, self.stopped = own, {}, threading.Event()

    def _grandchildren(self) -> list[int]:
        parent = {}
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
        children = {p for p, pp in parent.items() if pp == os.getpid()}
        return [p for p, pp in parent.items() if pp in children]

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            for pid in ["self"] if self.own else self._grandchildren():
                mb = private_mb(pid)
                if mb is not None:
                    self.peaks[pid] = max(mb, self.peaks.get(pid, 0.0))

    def stop(self) -> float:
        self.stopped.set()
        self.join()
        return max(self.peaks.values(), default=float("nan"))


def run_exogym(model: str, k: int, name: str, steps: int, warmup: int, processes: int) -> dict:
    from exogym import Trainer

    net, data, batch = workload(model, k, steps)
    trainer = Trainer(net, data)
    sampler = PrivatePeak(own=processes == 1) if os.environ.get("BENCH_PRIVATE") else None
    if sampler is not None:
        sampler.start()
    started = time.perf_counter()
    trainer.fit(strategy(name), k, batch_size=batch, max_steps=steps, device="cpu", progress=False, logger=False,
                val_size=1, val_interval=10**6, processes=processes)
    total = time.perf_counter() - started
    walls = trainer.record.column("wall_time_s")  # seconds since the run started, per step
    per_step = (walls[-1] - walls[warmup - 1]) / (steps - warmup)
    own = [c["process_peak_rss_mb"] for c in trainer.record.comm_per_node if "process_peak_rss_mb" in c]
    peak = max(own) if own else trainer.record.peak_memory_mb["process_rss"]  # per simulating process
    private = sampler.stop() if sampler is not None else None
    return {"step_s": per_step, "startup_s": total - per_step * steps, "peak_mb": peak, "private_mb": private}


def _plain_process(rank: int, model: str, k: int, name: str, steps: int, warmup: int, port: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mine = range(rank * k // 2, (rank + 1) * k // 2)
    torch.manual_seed(0)
    base = (MLP if model == "mlp" else SmallCNN)()
    models = [(MLP if model == "mlp" else SmallCNN)() for _ in mine]
    for m in models:
        m.load_state_dict(base.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    outer = [p.detach().clone() for p in base.parameters()]
    outer_opt = torch.optim.SGD([torch.nn.Parameter(p) for p in outer], lr=0.7, momentum=0.9, nesterov=True)
    data = make_data(k * BATCH * (steps + 1))
    shards = [torch.as_tensor(list(DistributedSampler(data, num_replicas=k, rank=r, seed=0))) for r in mine]
    started = None
    for s in range(steps):
        if s == warmup:
            dist.barrier()
            started = time.perf_counter()
        for m, o, shard in zip(models, opts, shards):
            idx = shard[s * BATCH:(s + 1) * BATCH]
            o.zero_grad()
            m((data.tensors[0][idx], data.tensors[1][idx])).backward()
        if name == "ddp":
            with torch.no_grad():  # the local sum, one all-reduce, the mean into every copy's gradient
                flat = torch.cat([torch.stack([p.grad for p in ps]).sum(0).flatten()
                                  for ps in zip(*(m.parameters() for m in models))])
                dist.all_reduce(flat)
                flat.div_(k)
                for m in models:
                    torch.nn.utils.vector_to_parameters(flat, [p.grad for p in m.parameters()])
        for o in opts:
            o.step()
        if name == "diloco" and (s + 1) % H == 0:
            with torch.no_grad():
                mean = torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()) for m in models]).sum(0)
                dist.all_reduce(mean)
                mean.div_(k)
                params = outer_opt.param_groups[0]["params"]
                start = torch.nn.utils.parameters_to_vector(params)
                for p, g in zip(params, torch.split(start - mean, [p.numel() for p in params])):
                    p.grad = g.view_as(p).clone()
                outer_opt.step()
                new = torch.nn.utils.parameters_to_vector(params)
                for m in models:
                    torch.nn.utils.vector_to_parameters(new, m.parameters())
    dist.barrier()
    if rank == 0:
        out.put((time.perf_counter() - started) / (steps - warmup))
    dist.destroy_process_group()


def run_plain(model: str, k: int, name: str, steps: int, warmup: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    started = time.perf_counter()
    mp.start_processes(_plain_process, args=(model, k, name, steps, warmup, port, out), nprocs=2, start_method="spawn")
    per_step = out.get()
    return {"step_s": per_step, "startup_s": time.perf_counter() - started - per_step * steps}


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def child(mode: str, model: str, k: int, name: str, steps: int, warmup: int) -> None:
    torch.set_num_threads(2 if mode == "1 proc, 2 thr" else 1)
    if mode == "idle":  # the base every process pays: the interpreter, torch and exogym imported
        import exogym  # noqa: F401
        result = {"peak_mb": peak_rss_mb()}
        importlib.import_module("torch._dynamo")  # what torch.optim imports on first use; the forkserver preloads it
        result["private_mb"] = private_mb()
    elif mode == "plain 2 procs":
        result = run_plain(model, k, name, steps, warmup)
    else:
        result = run_exogym(model, k, name, steps, warmup, 2 if mode == "2 procs" else 1)
    print(json.dumps(result))


def measure(mode: str, model: str, k: int, name: str, steps: int, warmup: int, private: bool = False) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, model, str(k), name, str(steps), str(warmup)],
                         capture_output=True, text=True, env={**os.environ, **({"BENCH_PRIVATE": "1"} if private else {})})
    if out.returncode:
        raise RuntimeError(f"{mode} {model} K={k} {name} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=["mlp", "cnn", "gpt"],
                        help="default: mlp cnn (--memory: mlp cnn gpt)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "diloco"], choices=["ddp", "diloco", "gossip"],
                        help="gossip: --memory only (the plain loop has no gossip)")
    parser.add_argument("--seconds", type=float, default=10.0, help="aim for runs at least this long (timed part)")
    parser.add_argument("--memory", action="store_true",
                        help="instead: peak resident memory per simulating process, 1 process against 2 (20 steps)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, model, k, name, steps, warmup = args.child
        return child(mode, model, int(k), name, int(steps), int(warmup))
    if "gossip" in args.strategies and not args.memory:
        parser.error("--strategies gossip is measured with --memory only")
    if args.memory:
        idle = measure("idle", "mlp", 1, "ddp", 1, 1)
        print(f"per simulating process (the caller apart), 20 steps, one thread each: peak resident MB above an idle "
              f"process that imported torch and exogym ({idle['peak_mb']:.0f} MB); peak private MB (USS) above that of an "
              f"idle process that imported torch, torch._dynamo and exogym ({idle['private_mb']:.0f} MB), which a "
              "process of 2 shares with the forkserver it was forked from (so: its whole private memory)")
        print(f"{'':>18} {'resident':>30}   {'private':>30}")
        print(f"{'model':>5} {'K':>3} {'strategy':>8} " + f"{'1 process':>10} {'2 processes':>12} {'ratio':>6}   " * 2)
        for model in args.models or ["mlp", "cnn", "gpt"]:
            for k in args.nodes:
                for name in args.strategies:
                    one, two = (measure(m, model, k, name, 20, H, private=True) for m in ("1 proc, 1 thr", "2 procs"))
                    # A forkserver's child shares the idle modules with the forkserver: its own private memory is
                    # what it adds to them (nothing at the fork).
                    cells = [(one["peak_mb"] - idle["peak_mb"], two["peak_mb"] - idle["peak_mb"]),
                             (one["private_mb"] - idle["private_mb"], two["private_mb"])]
                    print(f"{model:>5} {k:>3} {name:>8} "
                          + "   ".join(f"{a:>10.0f} {b:>12.0f} {b / a:>6.2f}" for a, b in cells), flush=True)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, batch {BATCH}/node, AdamW, DiLoCo H={H}; "
          "wall seconds per step after the warm-up (start-up apart); each cell its own process")
    print(f"{'model':>5} {'K':>3} {'strategy':>8} {'steps':>5} " + " ".join(f"{m:>14}" for m in MODES)
          + f" {'2p/1p1t':>8} {'2p/plain':>8} {'start-up s (1p, 2p, plain)':>28}")
    for model in args.models or ["mlp", "cnn"]:
        for k in args.nodes:
            for name in args.strategies:
                probe = measure("1 proc, 1 thr", model, k, name, 12, 2)  # how many steps make --seconds
                steps = max(20, int(args.seconds / probe["step_s"]))
                steps += (-steps) % H
                cells = {m: measure(m, model, k, name, steps, H) for m in MODES}
                one, two, plain = cells["1 proc, 1 thr"], cells["2 procs"], cells["plain 2 procs"]
                print(f"{model:>5} {k:>3} {name:>8} {steps:>5} "
                      + " ".join(f"{cells[m]['step_s'] * 1e3:>11.1f} ms" for m in MODES)
                      + f" {two['step_s'] / one['step_s']:>8.2f} {two['step_s'] / plain['step_s']:>8.2f} "
                      + f"{one['startup_s']:>9.1f} {two['startup_s']:>8.1f} {plain['startup_s']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
