"""
This process of a run (alone, or one of torchrun's ranks): set up, mixed precision, what rank 0 alone does, teardown.
"""

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from support import kernels, threads

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Process:
    """This process: its rank among `world` processes, its device, its steps' torch.compile backend (None: eager)."""
    rank: int
    world: int
    device: torch.device
    compiled: str | None = None


def setup(device="auto", timeout_minutes=60.0, compile="false"):
    """-> this Process, its CPU threads set and `compile` resolved for its device. Under torchrun: join the process
    group (NCCL on GPU, gloo on CPU) and take this rank's GPU; without: rank 0 of 1 on `device`. `timeout_minutes` must
    cover the other ranks' wait while rank 0 writes a checkpoint: on a slow filesystem far longer than NCCL's 10."""
    cuda = device != "cpu" and torch.cuda.is_available()
    if device.startswith("cuda") and not cuda:
        raise SystemExit(f"device={device!r}: PyTorch sees no CUDA GPU here ({torch.__version__}); use --device=cpu "
                         "or auto, or install a CUDA build of PyTorch")
    if "RANK" not in os.environ:
        rank, world, dev = 0, 1, torch.device(device if device != "auto" else ("cuda" if cuda else "cpu"))
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local_rank)
        # Imported before the process group exists, not by DDP's constructor after it: torch._dynamo imports modules
        # (torch.distributed.fsdp's ShardedGradScaler) with `process_group=dist.group.WORLD` as a default argument,
        # which would hold the world group for the interpreter's life, past destroy_process_group (see teardown).
        from torch import _dynamo  # noqa: F401
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=timeout_minutes))
        rank, world, dev = dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    compiled = kernels.compiler(compile, dev)
    threads.setup(dev, compiled)  # CPU: threads for the CPUs this process may use, fewer while other jobs load them
    return Process(rank, world, dev, compiled)


@contextlib.contextmanager
def said_once():
    """For the checks before the process group, which every torchrun process runs alike: rank 0 alone says why."""
    try:
        yield
    except SystemExit as e:
        if int(os.environ.get("RANK", 0)) > 0 and isinstance(e.code, str):
            quiet_exit()
        raise


def quiet_exit():
    """A rank > 0 exits 1 once rank 0 has had time to say why (torchrun ends this wait as soon as rank 0 exits)."""
    time.sleep(5.0)
    raise SystemExit(1) from None


def on_rank0(fn, process):
    """fn() on rank 0 alone; its result on every rank, or the SystemExit it raised: its message on rank 0 alone (a
    mistake is said once), the same exit code everywhere, no rank left waiting in a collective for one that stopped."""
    result = None
    if process.rank == 0:
        try:
            result = fn()
        except SystemExit as e:
            result = e
    if dist.is_initialized():
        box = [result]
        dist.broadcast_object_list(box)
        result = box[0]
    if isinstance(result, SystemExit):
        if process.rank > 0:
            quiet_exit()
        raise result
    return result


def autocast(device, dtype="auto"):
    """-> (autocast context, compute dtype). "auto": bfloat16 autocast on GPU (the attention kernels take 16-bit q, k,
    v only), float32 on CPU; weights stay float32. TF32 for the float32 matmuls left (norms, losses, float32 runs)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise SystemExit(f"dtype={dtype!r}: choose auto, {', '.join(DTYPES)}")
    dt = DTYPES[dtype]
    return torch.autocast(device.type, dtype=dt, enabled=dt != torch.float32), dt


def teardown():
    """Leave the process group after the prefetch thread and the DDP model, joining its threads (gloo's, the TCPStore)
    before exit: freed at finalization, a rank sometimes aborted (SIGABRT) and torchrun said a finished run failed."""
    if dist.is_initialized():
        dist.destroy_process_group()
