"""Where the per-transfer formula was optimistic: asynchronous training on links that transfers share.

    python examples/shared_links.py               # the tables (about 40 s on 2 shared cores at load 3)
    python examples/shared_links.py --nodes 4 16  # fewer runs

K nodes (steps of 0.10 to 0.15 simulated seconds: node speeds 1.0 down to 0.67) train an MLP 784-128-10 on MNIST
with AdamW inner steps (batch 32 per node) through a server behind a 50 Mbit/s link (20 ms), for the same
simulated time (--budget seconds: each node trains until its clock reaches it). Each strategy runs twice: with the
links shared max-min fairly by the transfers in flight (exogym.cluster.flows, the default), and with every
transfer alone at its route's bandwidth (`Network(shared_links=False)`: the formula per transfer, as before).
Printed per run: server updates applied within the budget, the global model's validation loss at the end, the
run's simulated time (the budget, and the transfers still in flight then), goodput (the nodes' compute over K x the run's
simulated time; a node waiting for the link is not computing), and how busy the server's link was each way (the share of the run's simulated time it carried at least one
transfer: uploads into the server, the model back out).

Then training over two datacenters of --dc-nodes/2 nodes each (1 Gbit/s, 1 ms inside; one link between them each
way, 30 ms, one table per --wan bandwidth), where the collectives share the links too (a collective occupies the
ports and WAN links its ring crosses, with the bytes its formula counts): asynchronous DiLoCo with its server in
datacenter 0, for the budget, whose other datacenter's uploads share the WAN; then, for 0.8 x budget / 0.1 steps
(whole rounds), synchronous DiLoCo (one all-reduce of every node at a time: alone on the WAN), Streaming DiLoCo
(one fragment every H/F steps, its all-reduce overlapping tau steps of compute) and FedAvg with islands (each
round the nodes are shuffled into islands that all-reduce at once, most of them across the WAN). Printed: rounds,
val loss, simulated seconds, goodput and the share of the run each WAN direction carried at least one transfer.
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
from exogym.strategy import (AsyncDiLoCoStrategy, DiLoCoStrategy, FedAvgStrategy, FedBuffStrategy, OptimSpec,
                             StreamingDiLoCoStrategy)

BATCH, H, STEP_S = 32, 10, 0.10
FRAGMENTS, TAU = 2, 4  # Streaming DiLoCo: the MLP's two layers, one each H/F = 5 steps, overlapping 4 of them
ISLANDS = (4, 8)  # FedAvg's island sizes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64], help="K values (default 4 16 64)")
    parser.add_argument("--budget", type=float, default=8.0, help="simulated seconds per run (default 8)")
    parser.add_argument("--dc-nodes", type=int, default=16, help="nodes over the two datacenters (default 16)")
    parser.add_argument("--wan", nargs="+", default=["100Mbps", "10Mbps"],
                        help="bandwidths of the link between the datacenters, one table each (default 100Mbps 10Mbps)")
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
    use = (x["links"] or {}).get(link)
    return "-" if use is None else f"{use['busy_s'] / x['sim_s']:.0%}"


def two_datacenters(k: int, wan: str, budget: float, sync_steps: int, adamw: OptimSpec, data, flops: float) -> None:
    """The table of the strategies over two datacenters of k/2 nodes sharing one WAN of `wan` each way."""
    two = dict(bandwidth="1Gbps", latency="1ms", datacenters=[list(range(k // 2)), list(range(k // 2, k))],
               inter_bandwidth=wan, inter_latency="30ms")
    syncs = {"sync DiLoCo": lambda: DiLoCoStrategy(adamw, H=H),
             f"Streaming DiLoCo, F={FRAGMENTS}, tau={TAU}": lambda: StreamingDiLoCoStrategy(
                 adamw, H=H, num_fragments=FRAGMENTS, tau=TAU),
             **{f"FedAvg, islands of {size}": (lambda size=size: FedAvgStrategy(adamw, H=H, island_size=size))
                for size in ISLANDS}}
    print(f"\nTwo datacenters of {k // 2} nodes, WAN {wan}, {two['inter_latency']}; asynchronous DiLoCo for "
          f"{budget:g} simulated seconds, the others {sync_steps} steps\n")
    print("| strategy | links | server updates / rounds | val loss | simulated s | goodput | WAN busy, 0>1 / 1>0 |")
    print("|---|---|---|---|---|---|---|")
    for shared in (False, True):
        net = Network(**two, server_datacenter=0, shared_links=shared)
        x = run(AsyncDiLoCoStrategy(adamw, H=H, outer_lr=0.05, delayed_nesterov="full_steps", time_budget_s=budget),
                k, net, data, flops, max_steps=int(budget / STEP_S * 1.5) + H)
        row("async DiLoCo, server in datacenter 0", shared, x["updates"], x)
    for name, make in syncs.items():
        for shared in (False, True):
            x = run(make(), k, Network(**two, shared_links=shared), data, flops, max_steps=sync_steps)
            row(name, shared, sync_steps // H, x)


def row(name: str, shared: bool, count: int, x: dict) -> None:
    print(f"| {name} | {'shared' if shared else 'per transfer'} | {count} | {x['loss']:.4f} | {x['sim_s']:.2f} | "
          f"{x['goodput']:.2f} | {busy(x, 'wan 0>1')} / {busy(x, 'wan 1>0')} |", flush=True)


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
    sync_steps = int(args.budget / STEP_S * 0.8) // H * H
    for wan in args.wan:
        two_datacenters(k, wan, args.budget, sync_steps, adamw, data, flops)
    print(f"\n{time.perf_counter() - t0:.0f} s wall")


if __name__ == "__main__":
    main()
