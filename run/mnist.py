"""`python run/mnist.py`: DDP, DiLoCo, SPARTA, FedAvg and DeMo compared on real MNIST (examples/mnist.py).

Every flag of examples/mnist.py works here (--steps, --lr, --seed, --device, --published).
"""

from _examples import load_example

if __name__ == "__main__":
    load_example("mnist").main()
