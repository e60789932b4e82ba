"""The parts of a fused step, timed apart: where batching K nodes pays on this machine and where it cannot.

1. matmul: K nodes' layers as one bmm against K separate matmuls, and against one weight times a K-times larger
   batch (what the one-model limit computes), for the GPT's and the MLP's layer shapes;
2. linear forward/backward under vmap: F.linear (its weight gradient comes back transposed and is copied into
   the parameter's layout) against exogym.backends.sim.fused.layers' (W x^T)^T, for the 784-256-256-10 MLP at 32 rows/node;
3. the optimizer: K nodes' AdamW steps one per node with torch's for-loop implementation, one per node with its
   fused kernel (what fused runs take, exogym.backends.sim.fused.kernel), stacked [K, ...] with the for-loop,
   and the fused kernel in one call over all the nodes' tensors (not taken: it needs each node's step replaced).
CPU time per call in ms, fastest of --repeat runs of --calls calls.
Usage: python benchmarks/bench_fused_parts.py [--threads 1] [--nodes 8 32]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from workload import MLP


def best_ms(fn, calls: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - started) / calls)
    return best * 1e3


def matmuls(k: int, calls: int, repeat: int) -> None:
    print(f"1. matmul, K = {k}: ms per call (x [K, rows, in] times W [K, out, in]^T)")
    print(f"{'rows':>6} {'in':>5} {'out':>5} {'K matmuls':>10} {'one bmm':>9} {'one weight, K x rows':>21}")
    for rows, d_in, d_out in ((512, 128, 384), (512, 512, 128), (32, 784, 256), (32, 256, 256)):
        x, w = torch.randn(k, rows, d_in), torch.randn(k, d_out, d_in)
        xs, ws = list(x.unbind(0)), list(w.unbind(0))
        loop = best_ms(lambda: [a @ b.t() for a, b in zip(xs, ws)], calls, repeat)
        batched = best_ms(lambda: torch.bmm(x, w.transpose(1, 2)), calls, repeat)
        one = best_ms(lambda: x.reshape(-1, d_in) @ ws[0].t(), calls, repeat)
        print(f"{rows:>6} {d_in:>5} {d_out:>5} {loop:>10.2f} {batched:>9.2f} {one:>21.2f}")


def linear_layouts(k: int, calls: int, repeat: int) -> None:
    from exogym.backends.sim.fused.layers import batching_friendly

    plain = MLP()
    fast = batching_friendly(plain)
    x, y = torch.randn(k, 32, 1, 28, 28), torch.randint(0, 10, (k, 32))

    def step(module):
        stacks = {n: torch.randn(k, *p.shape).requires_grad_() for n, p in module.named_parameters()}

        def run():
            loss = vmap(lambda p, a, b: functional_call(module, p, ((a, b),)))(stacks, x, y).sum()
            return [g.contiguous() for g in torch.autograd.grad(loss, list(stacks.values()))]
        return run

    a, b = best_ms(step(plain), calls, repeat), best_ms(step(fast), calls, repeat)
    print(f"2. MLP forward/backward under vmap, K = {k}, gradients in the parameters' layout: F.linear {a:.2f} ms, "
          f"(W x^T)^T {b:.2f} ms ({b / a:.2f}x)")


def optimizers(k: int, calls: int, repeat: int) -> None:
    shapes = [p.shape for p in MLP().parameters()]

    def with_grads(params):
        for p in params:
            p.grad = torch.randn_like(p)
        return params

    per_node = [torch.optim.AdamW(with_grads([torch.randn(s, requires_grad=True) for s in shapes])) for _ in range(k)]
    kernel = [torch.optim.AdamW(with_grads([torch.randn(s, requires_grad=True) for s in shapes]), fused=True)
              for _ in range(k)]
    stacked = torch.optim.AdamW(with_grads([torch.randn(k, *s, requires_grad=True) for s in shapes]))
    listed = torch.optim.AdamW([p for o in kernel for p in o.param_groups[0]["params"]], fused=True)
    a = best_ms(lambda: [o.step() for o in per_node], calls, repeat)
    f = best_ms(lambda: [o.step() for o in kernel], calls, repeat)
    b = best_ms(stacked.step, calls, repeat)
    c = best_ms(listed.step, calls, repeat)
    print(f"3. K = {k} MLP nodes' AdamW steps: one per node {a:.2f} ms, one per node with the fused kernel {f:.2f} "
          f"ms, stacked for-loop {b:.2f} ms, fused kernel in one call over the nodes' tensors {c:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU time, "
          f"fastest of {args.repeat} x {args.calls} calls")
    for k in args.nodes:
        matmuls(k, args.calls, args.repeat)
        linear_layouts(k, args.calls, args.repeat)
        optimizers(k, args.calls, args.repeat)


if __name__ == "__main__":
    main()
