"""Two xdist workers share the cores: each runs its in-process ops on one thread, so that neither spins at OpenMP's
barrier while the other holds the core it waits for (support/threads.py says why)."""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
