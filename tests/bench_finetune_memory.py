"""Peak memory of one full-context fine-tuning step (eval.accumulate, then AdamW) against the token budget
of a micro batch: a batch of 16 examples at the model's full context, split under --max_tokens, or in one
forward. Each setting runs in a process of its own, since a process's peak RSS never goes down.

    python tests/bench_finetune_memory.py                 # CPU, a small model, 16 x 2048 tokens
    python tests/bench_finetune_memory.py --hidden 768 --layers 22 --context 8192 --device cuda   # Base, a GPU

Not a test: it prints a table (peak RSS on CPU, peak allocated on CUDA; median seconds of 3 steps).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from eval import accumulate  # noqa: E402
from model import ModernBertConfig, ModernBertForSequenceClassification  # noqa: E402


def one(a):
    """One setting, in this process: -> {"peak_mib", "base_mib", "seconds"}."""
    device = torch.device(a.device)
    torch.manual_seed(0)
    config = ModernBertConfig(vocab_size=50368, hidden_size=a.hidden, intermediate_size=a.hidden * 3 // 2,
                              num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                              max_position_embeddings=a.context, id2label={"0": "a", "1": "b"})
    model = ModernBertForSequenceClassification(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(5, 50368, (a.context,), generator=g).tolist(), k % 2) for k in range(a.batch_size)]
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731 (KiB on Linux)
    base = torch.cuda.memory_allocated() / 2 ** 20 if device.type == "cuda" else rss()
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        accumulate(model, items, "cls", device, 1 / len(items), a.max_tokens, autocast)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2 ** 20 if device.type == "cuda" else rss()
    return {"peak_mib": peak, "base_mib": base, "seconds": statistics.median(seconds)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=2048, help="tokens per example: the model's full context")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--budgets", default="2048,4096,8192", help="the --max_tokens to compare with one batch")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max_tokens", type=int, help=argparse.SUPPRESS)  # one setting (the child process)
    a = p.parse_args()
    if a.max_tokens:
        print(json.dumps(one(a)))
        return
    shared = [f"--{k}={getattr(a, k)}" for k in ("hidden", "layers", "context", "batch_size", "device")]
    budgets = [int(b) for b in a.budgets.split(",")] + [a.batch_size * a.context]  # the last: one batch
    rows = []
    for b in budgets:
        r = subprocess.run([sys.executable, __file__, *shared, f"--max_tokens={b}"], capture_output=True, text=True,
                           check=True)
        rows.append((b, json.loads(r.stdout.strip().splitlines()[-1])))
    whole = rows[-1][1]
    what = "peak allocated" if a.device.startswith("cuda") else "peak RSS"
    print(f"{a.batch_size} examples x {a.context} tokens, hidden {a.hidden}, {a.layers} layers, {a.device}")
    print(f"| max_tokens | micro batches | {what} (MiB) | above the model (MiB) | vs one batch | s/step (median) |")
    print("|---|---|---|---|---|---|")
    for b, r in rows:
        n = -(-a.batch_size // max(1, b // a.context))
        name = f"{b} (one batch)" if b == budgets[-1] else str(b)
        print(f"| {name} | {n} | {r['peak_mib']:.0f} | {r['peak_mib'] - r['base_mib']:.0f} | "
              f"{(r['peak_mib'] - r['base_mib']) / (whole['peak_mib'] - whole['base_mib']):.2f} | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
