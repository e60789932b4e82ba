"""`python run/mnist.py`: DDP, DiLoCo, SPARTA, FedAvg and DeMo compared on real MNIST (examples/mnist.py).

Every flag of examples/mnist.py works here (--steps, --lr, --seed, --device, --published, --out,
--update-docs). The outputs go under runs/ (git-ignored); only --update-docs, with the published settings,
writes into docs/img.
"""

from _examples import load_example

if __name__ == "__main__":
    load_example("mnist").main()
