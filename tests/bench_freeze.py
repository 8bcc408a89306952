"""Step time with layers frozen, CPU, one process (not collected by pytest):

    python tests/bench_freeze.py            # ~2 minutes on 2 cores

A 22-layer model (ModernBERT-base's depth, half its width), layers 0-7 frozen as in the paper's freeze runs,
one optimizer step of train.py (forward_backward, AdamW step) on 4 x 128-token CLM windows:
  none : nothing frozen (the reference)
  drop : the frozen layers' weight gradients computed, then dropped before the step (the code before)
  skip : support/freeze.py: the frozen layers' weights require no gradient, none is computed
The three take their steps in turn, so that a change in the machine's load hits them alike; each row is the
median of its timed steps in CPU time (process_time: on a shared machine, time waiting for a core is not
the step's), with its ratios in the same run.
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import clm_batch  # noqa: E402
from model import ModernBertConfig, ModernBertForMaskedLM  # noqa: E402
from support.distributed import Process  # noqa: E402
from support.freeze import Freeze  # noqa: E402
from train import Config, Phase, forward_backward, make_optimizer  # noqa: E402

STEPS, WARMUP = 15, 2


def main():
    torch.set_num_threads(1)
    config = ModernBertConfig(vocab_size=1024, hidden_size=384, intermediate_size=576, num_hidden_layers=22,
                              num_attention_heads=6, local_attention=64)
    c = Config(freeze_layers="0-7", freeze_phase="main", lr=1e-3)
    phase, cpu = Phase("main", "clm", 1), torch.device("cpu")
    process, autocast = Process(0, 1, cpu), torch.autocast("cpu", enabled=False)
    batch = clm_batch(torch.randint(3, 1024, (4, 128), generator=torch.Generator().manual_seed(0)), eos_id=2)
    runs = {}
    for variant in ("none", "drop", "skip"):
        torch.manual_seed(0)
        model = ModernBertForMaskedLM(config)
        optimizer = make_optimizer(model, c, cpu)
        freeze = Freeze(c, model, ["main"])
        if variant == "skip":
            freeze.enter(phase)
        runs[variant] = (model, optimizer, freeze.params if variant == "drop" else [])
    times = {variant: [] for variant in runs}
    for k in range(WARMUP + STEPS):  # step by step in turn, so that the machine's load hits the three alike
        for variant, (model, optimizer, dropped) in runs.items():
            started = time.process_time()
            forward_backward(model, [batch], True, process, autocast, False)
            for p in dropped:
                p.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if k >= WARMUP:
                times[variant].append(time.process_time() - started)
    medians = {variant: statistics.median(t) for variant, t in times.items()}
    print(f"22 layers x 384, layers 0-7 frozen, 4 x 128 tokens CLM, CPU 1 thread; median of {STEPS} steps each")
    print(f"| {'variant':<7} | step ms | vs none | vs drop |")
    print("|---------|---------|---------|---------|")
    for variant, median in medians.items():
        print(f"| {variant:<7} | {1000 * median:7.1f} | {median / medians['none']:7.3f} | "
              f"{median / medians['drop']:7.3f} |")


if __name__ == "__main__":
    main()
