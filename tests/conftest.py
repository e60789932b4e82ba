import os
import sys

import torch

# Test modules in subfolders import the shared toy models as `toy`.
sys.path.insert(0, os.path.dirname(__file__))

# One intra-op thread: CI machines have 2 cores, and results must not depend on thread count.
torch.set_num_threads(1)
