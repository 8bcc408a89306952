"""The tests' in-process ops run on one thread, as their subprocesses do (OMP_NUM_THREADS=1): their numbers are then
equal, tiny matmuls on shared threads crawl, and two xdist workers never spin at OpenMP's barrier while the other
holds the core each waits for (support/threads.py says why)."""

import torch

torch.set_num_threads(1)
