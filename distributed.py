"""The few lines of torch.distributed set-up that train.py, cka.py and eval.py share."""

import os

import torch
import torch.distributed as dist


def setup(device="auto"):
    """-> (rank, world_size, device). Under torchrun: join the process group (NCCL on GPU, gloo on
    CPU) and take this rank's GPU. Without torchrun: one process on `device`."""
    cuda = device != "cpu" and torch.cuda.is_available()
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device if device != "auto" else ("cuda" if cuda else "cpu"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}" if cuda else "cpu")


def teardown():
    if dist.is_initialized():
        dist.destroy_process_group()
