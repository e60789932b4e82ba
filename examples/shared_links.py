"""Where the per-transfer formula was optimistic: asynchronous training on links that transfers share.

    python examples/shared_links.py               # the tables (about 4 minutes on 2 shared cores)
    python examples/shared_links.py --nodes 4 16  # fewer runs

K nodes (steps of 0.10 to 0.15 simulated seconds: node speeds 1.0 down to 0.67) train an MLP 784-128-10 on MNIST
with AdamW inner steps (batch 32 per node) through a server behind a 100 Mbit/s link (20 ms), for the same
simulated time (--budget seconds: each node trains until its clock reaches it). Each strategy runs twice: with the
links shared max-min fairly by the transfers in flight (exogym.cluster.flows, the default), and with every
transfer alone at its route's bandwidth (`Network(shared_links=False)`: the formula per transfer, as before).
Printed per run: server updates applied within the budget, the global model's validation loss at the end, the
run's simulated time (the budget, and the transfers still in flight then), goodput (the nodes' compute over K x the run's simulated time; a node waiting for the link is not computing),
and how busy the server's link was each way (the share of the run's simulated time it carried at least one
transfer: uploads into the server, the model back out).

Then DiLoCo over two datacenters of K/2 nodes each (1 Gbit/s, 1 ms inside; one 100 Mbit/s, 30 ms WAN between):
asynchronous DiLoCo with its server in datacenter 0, whose other datacenter's uploads share the WAN, and
synchronous DiLoCo, whose one all-reduce at a time crosses the WAN once each way.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from exogym import Trainer
from exogym.cluster.network import Network
from exogym.data.mnist import load_mnist
from exogym.models import MLPClassifier
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, FedBuffStrategy, OptimSpec

BATCH, H, STEP_S = 32, 10, 0.10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64], help="K values (default 4 16 64)")
    parser.add_argument("--budget", type=float, default=8.0, help="simulated seconds per run (default 8)")
    parser.add_argument("--dc-nodes", type=int, default=16, help="nodes over the two datacenters (default 16)")
    return parser.parse_args()


def step_flops(batch) -> float:
    model = MLPClassifier(784, 10, hidden=128)
    with FlopCounterMode(display=False) as counter:
        model(batch)["loss"].backward()
    return float(counter.get_total_flops())


def run(strategy, k: int, network: Network, data, flops: float, **fit) -> dict:
    train, test = data
    torch.manual_seed(0)
    trainer = Trainer(MLPClassifier(784, 10, hidden=128), train, test)
    speeds = [1.0 - (1 / 3) * i / max(1, k - 1) for i in range(k)]
    trainer.fit(strategy, k, batch_size=BATCH, val_size=1000, device="cpu", network=network, node_speeds=speeds,
                device_flops=flops / STEP_S, logger=False, progress=False, **fit)
    r = trainer.record
    return {"updates": len(r.updates), "loss": r.val[-1]["global_loss"], "goodput": r.goodput, "sim_s": r.sim_time_s,
            "links": r.links}


def busy(x: dict, link: str) -> str:
    """The share of the run's simulated time `link` carried at least one transfer ("-": not recorded, per transfer)."""
    use = x["links"].get(link)
    return "-" if use is None else f"{use['busy_s'] / x['sim_s']:.0%}"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    data = load_mnist("train"), load_mnist("test")
    flops = step_flops((data[0].tensors[0][:BATCH], data[0].tensors[1][:BATCH]))
    adamw = OptimSpec(torch.optim.AdamW, lr=1e-3)
    server = dict(bandwidth="1Gbps", latency="20ms", server_bandwidth="50Mbps")
    makes = {"FedBuff": lambda k: FedBuffStrategy(adamw, H=H, buffer_size=max(2, k // 4), time_budget_s=args.budget),
             "async DiLoCo": lambda k: AsyncDiLoCoStrategy(adamw, H=H, outer_lr=0.05, delayed_nesterov="full_steps", time_budget_s=args.budget)}
    steps = int(args.budget / STEP_S * 1.5) + H
    print(f"server link {server['server_bandwidth']}, {server['latency']}; MLP 784-128-10 on MNIST, H={H}, "
          f"{args.budget:g} simulated seconds per run\n")
    print("| strategy | K | links | server updates | val loss | simulated s | goodput | server link busy, in / out |")
    print("|---|---|---|---|---|---|---|---|")
    for name, make in makes.items():
        for k in args.nodes:
            for shared in (False, True):
                x = run(make(k), k, Network(**server, shared_links=shared), data, flops, max_steps=steps)
                print(f"| {name} | {k} | {'shared' if shared else 'per transfer'} | {x['updates']} | "
                      f"{x['loss']:.4f} | {x['sim_s']:.2f} | {x['goodput']:.2f} | "
                      f"{busy(x, 'server down')} / {busy(x, 'server up')} |",
                      flush=True)

    k = args.dc_nodes
    two = dict(bandwidth="1Gbps", latency="1ms", datacenters=[list(range(k // 2)), list(range(k // 2, k))],
               inter_bandwidth="100Mbps", inter_latency="30ms")
    print(f"\nTwo datacenters of {k // 2} nodes, WAN {two['inter_bandwidth']}, {two['inter_latency']}; "
          f"{args.budget:g} simulated seconds (sync DiLoCo: {steps // H} rounds)\n")
    print("| strategy | links | server updates / rounds | val loss | simulated s | goodput | WAN 1>0 busy |")
    print("|---|---|---|---|---|---|---|")
    for shared in (False, True):
        net = Network(**two, server_datacenter=0, shared_links=shared)
        x = run(AsyncDiLoCoStrategy(adamw, H=H, outer_lr=0.05, delayed_nesterov="full_steps", time_budget_s=args.budget), k, net, data, flops, max_steps=steps)
        print(f"| async DiLoCo, server in datacenter 0 | {'shared' if shared else 'per transfer'} | {x['updates']} | "
              f"{x['loss']:.4f} | {x['sim_s']:.2f} | {x['goodput']:.2f} | "
              f"{busy(x, 'wan 1>0')} |", flush=True)
    for shared in (False, True):
        x = run(DiLoCoStrategy(adamw, H=H), k, Network(**two, shared_links=shared), data, flops,
                max_steps=int(args.budget / STEP_S * 0.8) // H * H)
        print(f"| sync DiLoCo | {'shared' if shared else 'per transfer'} | {x['updates'] or '-'} | {x['loss']:.4f} | "
              f"{x['sim_s']:.2f} | {x['goodput']:.2f} | - |", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s wall")


if __name__ == "__main__":
    main()
