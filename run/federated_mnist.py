"""`python run/federated_mnist.py --num_clients 100 --island_size 10`: FedAvg on MNIST in the FedAvg paper's
setting (examples/federated_mnist.py) with the client count, island size and round budget you choose.

Each round a fraction --client_fraction of the --num_clients clients (each holding its own digits: IID, or
--non_iid for the paper's two-label shards) trains --local_epochs epochs of SGD at batch --batch_size from the
global model; within each island of --island_size sampled clients the models are averaged. Printed: the test
accuracy of the global model after every round and a summary row; for the paper's full grid run
examples/federated_mnist.py.
"""

import argparse

from _examples import load_example

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_clients", type=int, default=100)
    parser.add_argument("--island_size", type=int, default=None, help="clients per island (default: one island)")
    parser.add_argument("--client_fraction", type=float, default=0.1)
    parser.add_argument("--local_epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=10)
    parser.add_argument("--non_iid", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=float, default=0.99)
    parser.add_argument("--val_size", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/federated_mnist_cli")
    args = parser.parse_args()
    fm = load_example("federated_mnist")
    fm.NUM_CLIENTS, fm.CLIENT_FRACTION = args.num_clients, args.client_fraction  # the example's two module settings
    from pathlib import Path

    from exogym.data.mnist import load_mnist

    kind = "non-IID" if args.non_iid else "IID"
    islands = f", islands of {args.island_size}" if args.island_size else ""
    setting = fm.Setting(f"E={args.local_epochs} B={args.batch_size}, {kind}{islands}", args.local_epochs,
                         args.batch_size, args.non_iid, island_size=args.island_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = fm.run("cli", setting, load_mnist("train"), load_mnist("test"), lr=args.lr, max_rounds=args.rounds,
                    check_every=1, target=args.target, val_size=args.val_size, seed=args.seed, device=args.device,
                    out=out)
    print("\n" + fm.table([result], args.target))
