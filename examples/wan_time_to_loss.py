"""Which strategy reaches a validation loss first on a slow wide-area network, in simulated time?

    python examples/wan_time_to_loss.py                  # MNIST, 8 nodes, 1 Gbit/s WAN with 50 ms latency
    python examples/wan_time_to_loss.py --target 0.3 --steps 400
    python examples/wan_time_to_loss.py --update-docs   # the default run, its JSON and plot into docs/img

Every run does the same steps on the same data (8 nodes x batch 16); the network model prices
each collective (ring all-reduce: 2N(R-1)/R / W + latency), compute is each step's counted FLOPs
at --device-tflops per node. Printed: the simulated seconds each strategy needs to reach the
target loss on 1,000 held-out digits, the total simulated time, and the share of it spent
communicating. The numbers go to runs/wan_time_to_loss.json (git-ignored; --out to move it) and,
with matplotlib, loss against simulated time to wan_loss_vs_time.png next to it; --update-docs writes
both into docs/img, with the default settings only.
"""

from __future__ import annotations

import argparse
import json

import torch

from exogym import Trainer
from exogym.data.mnist import load_mnist
from exogym.models import MnistCNN
from exogym.cluster.network import Network
from exogym.strategy import DeMoStrategy, DiLoCoStrategy, OptimSpec, SimpleReduceStrategy, SPARTAStrategy
from published_output import add_update_docs, output_path, print_outputs



def strategies(lr: float) -> list[tuple[str, object]]:
    adamw = OptimSpec(torch.optim.AdamW, lr=lr)
    return [("DDP", SimpleReduceStrategy(adamw)),
            *[(f"DiLoCo H={h}", DiLoCoStrategy(adamw, H=h)) for h in (10, 50, 200)],
            ("SPARTA p=0.005", SPARTAStrategy(adamw, p_sparta=0.005)),
            ("DeMo", DeMoStrategy(lr=lr))]


def time_to(target: float, record) -> float | None:
    """Simulated seconds at the first evaluation whose global loss is at or below target."""
    sim_at = {0: 0.0} | {int(r["step"]): r["sim_time_s"] for r in record.train}
    return next((sim_at[int(v["step"])] for v in record.val if v["global_loss"] <= target), None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.out resolved to the JSON file's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.35, help="validation loss to reach (default 0.35)")
    parser.add_argument("--bandwidth", default="1Gbps")
    parser.add_argument("--latency", default="50ms")
    parser.add_argument("--device-tflops", type=float, default=10.0, help="sustained TFLOP/s per node (default 10)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--out", default=None,
                        help="the JSON file of the numbers (default runs/wan_time_to_loss.json; the plot goes next "
                             "to it)")
    add_update_docs(parser, "wan_time_to_loss.json and wan_loss_vs_time.png")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "wan_time_to_loss.json", given=args.out)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)

    network = Network(bandwidth=args.bandwidth, latency=args.latency)
    train, test = load_mnist("train"), load_mnist("test")
    print(f"{args.nodes} nodes on {network}; {args.steps} steps of {args.nodes} x 16 examples; "
          f"compute at {args.device_tflops} TFLOP/s per node; target validation loss {args.target}\n")
    results = []
    for label, strategy in strategies(args.lr):
        torch.manual_seed(0)  # every run starts from the same initial model
        trainer = Trainer(MnistCNN(), train, test)
        trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=16, val_size=1000,
                    val_interval=max(1, args.steps // 20), device="cpu", network=network,
                    device_flops=args.device_tflops * 1e12, progress=True, logger=False)
        r = trainer.record
        clock = r.sim_time_per_node[0]
        results.append((label, time_to(args.target, r), r.sim_time_s, clock["comm_s"] / clock["now"],
                        r.val[-1]["global_loss"], r))
        print(f"{label:<15} reached: {results[-1][1]}  total {r.sim_time_s:.2f} s", flush=True)

    print(f"\n| strategy        | sim s to loss {args.target} | total sim s | communicating | final val loss |")
    print("|-----------------|---------------------|-------------|---------------|----------------|")
    for label, reach, total, comm_share, final, _ in sorted(results, key=lambda x: (x[1] is None, x[1] or 0)):
        reached = f"{reach:19.2f}" if reach is not None else f"{'not reached':>19}"
        print(f"| {label:<15} | {reached} | {total:11.2f} | {comm_share:12.1%} | {final:14.4f} |")
    out.write_text(json.dumps({
        "command": "python examples/wan_time_to_loss.py" + (" --update-docs" if args.update_docs else ""),
        "steps": args.steps, "nodes": args.nodes,
        "target": args.target, "network": str(network), "device_tflops": args.device_tflops,
        "runs": [{"label": label, "sim_s_to_target": reach, "total_sim_s": total, "communicating": comm_share,
                  "final_val_loss": final, "wire_bytes_per_node": r.bytes_per_node[0],
                  "payload_bytes_per_node": r.payload_bytes_per_node[0]}
                 for label, reach, total, comm_share, final, r in results]}, indent=1) + "\n")
    written = [out]
    try:
        from exogym.runs.plot import plot_runs
        written.append(plot_runs([r for *_, r in results], x="sim_time_s", y="global_loss",
                                 labels=[x[0] for x in results], out=out.with_name("wan_loss_vs_time.png"), log_x=True))
    except ImportError:
        print("\n(install matplotlib for the plot: pip install 'exogym[plot]')")
    print_outputs(written)


if __name__ == "__main__":
    main()
