"""The few lines of device set-up that train.py, cka.py and eval.py share: torch.distributed and
mixed precision."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Process:
    """This process: its rank among `world` processes, and its device."""
    rank: int
    world: int
    device: torch.device


def setup(device="auto"):
    """-> this Process. Under torchrun: join the process group (NCCL on GPU, gloo on CPU) and take
    this rank's GPU. Without torchrun: one process (rank 0 of 1) on `device`."""
    cuda = device != "cpu" and torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Process(0, 1, torch.device(device if device != "auto" else ("cuda" if cuda else "cpu")))
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return Process(dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}" if cuda else "cpu"))


def autocast(device, dtype="auto"):
    """-> (autocast context, compute dtype). "auto" is bfloat16 autocast on GPU (what the attention
    kernels need: they take 16-bit q, k, v only) and float32 on CPU. Weights stay float32 either way.
    TF32 is switched on for the float32 matmuls that remain on GPU (norms, losses, --dtype=float32)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise SystemExit(f"dtype={dtype!r}: choose auto, {', '.join(DTYPES)}")
    dt = DTYPES[dtype]
    return torch.autocast(device.type, dtype=dt, enabled=dt != torch.float32), dt


def teardown():
    """Leave the process group, only once the DDP model is gone: torch frees a process group without holding
    the GIL when it drops the last reference, but a DDP model freed later (at exit) frees it holding the GIL,
    and the exit then deadlocks on gloo's threads, which need the GIL to free the last collectives' tensors."""
    if dist.is_initialized():
        dist.destroy_process_group()
