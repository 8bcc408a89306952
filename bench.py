"""
Throughput and memory of this ModernBERT against transformers' ModernBertForMaskedLM,
on the same config, weights, device, dtype and batch, measured in the same run.

    python bench.py                                   # CPU, a small config, a few minutes
    python bench.py --compile on                      # + ours under torch.compile (CPU: ~25 min more)
    python bench.py --size base --seq_len 8192 --batch_size 4   # GPU: ModernBERT-base, packed 8192, bf16
    python bench.py --size base --seq_len 8192 --batch_size 4 --profile prof   # + where a step's time goes
    python bench.py --size tiny --steps 3              # what the test runs
    python bench.py --size base --seq_len 8192 --batch_size 4 --skip step loss data --attn_sizes base large
                                                      # GPU: each attention kernel at train.py's shapes
    python bench.py --size base --seq_len 8192 --batch_size 4 --impls "ours compiled" "ours regional" \
        "transformers compiled" --attn_backends varlen global=cudnn,local=varlen   # today's kernels vs others

Prints one table per section and writes bench.json:
  1. training step (forward + backward + AdamW step), tokens/s (median of --steps timed steps
     after warm-up), MFU and peak memory: ours eager, ours under torch.compile (--compile on;
     the default on CUDA) and transformers' ModernBertForMaskedLM, same weights and batches (--impls
     picks among these, ours regional and transformers compiled; --attn_backends runs ours with each), for
       a) variable-length batches (lengths from --lengths_from, else log-normal), where unpadding pays,
       b) fully packed sequences, where it cannot,
     for MLM (head on the 30% masked rows; transformers with sparse_prediction) and CLM (head on
     all rows; transformers' ModernBERT has no causal mask, so it runs bidirectional there).
     MFU = support/flops.training_flops (the batch's real sequence lengths) / step time / peak, the peak
     being the GPU's datasheet figure (support/flops.peak_flops, or --peak_tflops), else (CPU) the
     rate of a large matmul measured here; MFU_6N the same with the usual 6N + 12LHQT count;
  2. attention alone, forward and backward, each kernel (torch's varlen_attn, flash-attn, SDPA's cuDNN and flash
     kernels, FlexAttention, SDPA) on global and local layers, bidirectional and causal, packed and documents kept
     apart, against SDPA in float32, with its TFLOP/s; a kernel that cannot run a case says why;
  3. the LM loss's memory: one CLM forward + backward (vocab 50368, 8 x 1024 tokens, hidden 256)
     with the loss from full float32 logits against model.py's chunked loss;
  4. data (with --lengths_from and --tokenizer): prepare throughput against raw tiktoken, loader time per step;
  5. with --largest CAP: the largest micro batch (up to CAP sequences of seq_len) whose training step fits in
     the GPU's memory, MLM and CLM (eager, as section 1's ours; a compiled step keeps fewer activations).
Each measurement of sections 1, 3 and 5 runs in a fresh process, so peak memory is its own.

Three more run alone, `python bench.py NAME` (share: ~10 minutes on 2 cores; the others ~2):
  share: train.py configs/demo.py on CPU, quiet and beside --busy spinning processes, against its fair share;
  freeze: the CPU time of a training step with layers 0-7 of 22 frozen (support/freeze.py) against none;
  finetune_memory: a fine-tuning step's peak memory at the model's full context (--seq_len) by --max_tokens.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import Flat, ModernBertConfig, ModernBertForMaskedLM, Packing, attention, cu_seqlens_of
from support import kernels, suite
from support.flops import attention_pairs, convention_flops, peak_flops, training_flops
from support.freeze import Freeze
from support.threads import usable_cpus

ROOT = os.path.dirname(os.path.abspath(__file__))
SMALL_IDS = dict(pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)  # inside small vocabs
SIZES = {
    "tiny": ModernBertConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=2, **SMALL_IDS),
    "small": ModernBertConfig(vocab_size=8192, hidden_size=256, intermediate_size=384, num_hidden_layers=6,
                              num_attention_heads=4, **SMALL_IDS),
    "base": ModernBertConfig(),  # 22 x 768, vocab 50368
    "large": ModernBertConfig.large(),  # 28 x 1024
}


IMPLS = ("ours", "ours compiled", "ours regional", "transformers", "transformers compiled")


def rss_now():
    """Resident memory of this process now, bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_memory(device):
    """Start a peak-memory measurement: CUDA's allocator statistics, or on CPU Linux's resident
    high-water mark (so that what came before, torch.compile's compiling included, is not counted).
    Returns the resident memory now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # glibc keeps freed memory resident for reuse: give it back first, so that what the measured
        # code allocates shows up as new resident memory, as on a first step.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM
    return rss_now()


def peak_memory(device, before):
    """Since reset_peak_memory: CUDA's peak allocated bytes (weights and optimizer state included), or
    on CPU the peak resident memory above `before` (what the measured code added)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")) - before


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -----------------------------------------------------------------------------
# 1. Training step, one (implementation, case, objective) per process


def batch_lengths(case, batch_size, seq_len, rng, lengths_from):
    """Packed: batch_size sequences of seq_len. Variable: as many documents as make about the same
    number of tokens, with lengths from a real corpus (--lengths_from) or log-normal."""
    if case == "packed":
        return [seq_len] * batch_size
    lengths = []
    while sum(lengths) < batch_size * seq_len * 0.5:
        if lengths_from is not None:
            n = int(rng.choice(lengths_from))
        else:
            n = int(rng.lognormal(np.log(seq_len / 6), 0.9))
        lengths.append(min(max(n, 8), seq_len))
    return lengths


def make_inputs(lengths, vocab, objective, device, rng):
    """The same batch as both implementations take it: padded ids + mask + labels (transformers)
    and flat tokens + cu_seqlens + target rows (ours)."""
    B, S = len(lengths), max(lengths)
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.from_numpy(rng.integers(5, vocab, n))
        mask[b, :n] = 1
    labels = torch.full((B, S), -100)
    if objective == "mlm":
        chosen = torch.from_numpy(rng.random((B, S)) < 0.3) & mask.bool()
        labels[chosen] = ids[chosen]
    else:  # next token wherever there is one
        labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
    flat = Flat.of(ids, mask)
    tokens, cu, flat_labels = flat.tokens, flat.cu_seqlens, labels.flatten()[flat.keep]
    rows = (flat_labels != -100).nonzero().squeeze(1)
    to = lambda x: x.to(device)  # noqa: E731
    return dict(ids=to(ids), mask=to(mask), labels=to(labels), tokens=to(tokens), cu=to(cu), max_len=S,
                rows=to(rows), targets=to(flat_labels[rows]), lengths=lengths)


def measure_step(spec):
    """Runs in its own process: load the shared weights, time the training step, report peak memory,
    model FLOP/s and, under torch.compile, how many graphs were compiled."""
    device = torch.device(spec["device"])
    config = ModernBertConfig.from_pretrained(spec["ckpt"])  # ours, for the FLOPs of either implementation
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    if spec["impl"] == "ours":
        model = ModernBertForMaskedLM.from_pretrained(spec["ckpt"], attn_backend=spec["backend"]).to(device)
    else:
        import transformers
        model = transformers.ModernBertForMaskedLM.from_pretrained(
            spec["ckpt"], attn_implementation=spec["backend"],
            sparse_prediction=spec["objective"] == "mlm").to(device)  # the head on masked rows only
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if device.type == "cuda" else {}))
    step_fn = kernels.compile_model(model, regional=spec["compile"] == "regional") if spec["compile"] else model
    n_params = sum(p.numel() for p in model.parameters())  # the tied embedding once
    lengths_from = np.load(spec["lengths_from"]) if spec["lengths_from"] else None
    batches = [make_inputs(batch_lengths(spec["case"], spec["batch_size"], spec["seq_len"], rng, lengths_from),
                           config.vocab_size, spec["objective"], device, rng) for _ in range(3)]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if spec["impl"] == "ours" and spec["compile"]:  # as train.py: one graph for every number of MLM targets
        for x in batches:
            torch._dynamo.mark_dynamic(x["rows"], 0)
            torch._dynamo.mark_dynamic(x["targets"], 0)

    def step(x):
        with autocast:
            if spec["impl"] == "ours":  # as train.py: the chunked loss, through forward
                loss = step_fn(x["tokens"], causal=spec["objective"] == "clm", cu_seqlens=x["cu"],
                               max_seqlen=x["max_len"], rows=x["rows"], targets=x["targets"]) / x["targets"].numel()
            else:
                loss = step_fn(input_ids=x["ids"], attention_mask=x["mask"], labels=x["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # Compiled: warm up on every batch, so that the timed steps run graphs compiled already.
    t0 = time.perf_counter()
    for i in range(max(spec["warmup"], len(batches) if spec["compile"] else 0)):
        step(batches[i % len(batches)])
    sync(device)
    warmup_seconds = time.perf_counter() - t0
    before = reset_peak_memory(device)  # the memory of the timed steps only
    times, flops_per_s, convention_per_s = [], [], []
    for i in range(spec["steps"]):
        x = batches[i % len(batches)]
        sync(device)
        t0 = time.perf_counter()
        step(x)
        sync(device)
        times.append(time.perf_counter() - t0)
        # The FLOPs this implementation has to do: transformers' ModernBERT runs CLM bidirectionally.
        causal = spec["objective"] == "clm" and spec["impl"] == "ours"
        flops_per_s.append(training_flops(config, x["lengths"], causal, x["targets"].numel()) / times[-1])
        convention_per_s.append(convention_flops(config, n_params, sum(x["lengths"]), spec["seq_len"]) / times[-1])
    n_tokens = statistics.median([int(b["mask"].sum()) for b in batches])
    peak = peak_memory(device, before)
    if spec.get("profile"):  # one more step, under the profiler: where its time goes
        on_gpu = device.type == "cuda"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])) as prof:
            step(batches[0])
            sync(device)
        # The kernels alone on a GPU (the profiler also lists each op and launch around them), else each op's own time
        kind = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
        us = (lambda a: a.device_time_total) if on_gpu else (lambda a: a.self_cpu_time_total)  # noqa: E731
        rows = sorted((a for a in prof.key_averages() if a.device_type == kind), key=us, reverse=True)
        total = sum(map(us, rows))
        with open(spec["profile"], "w") as f:
            f.write(f"{spec['name']}, {spec['case']} {spec['objective']}, "
                    f"one step of {n_tokens} tokens; step median {statistics.median(times) * 1000:.1f} ms; "
                    f"{'kernels' if on_gpu else 'ops'} {total / 1000:.1f} ms\n")
            f.write(f"{'ms':>9} {'share':>6} {'calls':>6}  name\n")
            f.writelines(f"{us(a) / 1000:9.2f} {100 * us(a) / total:5.1f}% {a.count:6d}  {a.key[:110]}\n"
                         for a in rows[:30])
    compiles = None
    if spec["compile"]:
        from torch._dynamo.utils import counters
        compiles = counters["stats"]["unique_graphs"]  # every graph dynamo compiled, recompilations included
    return {"seconds": statistics.median(times), "tokens": n_tokens, "tokens_per_s": n_tokens / statistics.median(times),
            "flops_per_s": statistics.median(flops_per_s),
            "convention_flops_per_s": statistics.median(convention_per_s),
            "warmup_seconds": warmup_seconds, "peak_memory": peak, "compiles": compiles,
            "padded_tokens": statistics.median([b["ids"].numel() for b in batches])}


def run_worker(spec):
    """measure_step, measure_loss_memory, largest_batch or measure_finetune_memory (spec["task"]) in a fresh
    process: python bench.py --worker SPEC."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--worker", json.dumps(spec)],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"benchmark worker failed: {spec}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -----------------------------------------------------------------------------
# 2. Attention alone: each kernel on each layer type, against SDPA in float32

# model.py's backends, called as a layer calls them (model.attention), and SDPA's flash kernel: the FlashAttention-2
# that varlen_attn runs, on the packed (B, nh, S, hd) view, which takes no mask (the global layers of packed batches).
ATTENTION_KERNELS = ("varlen", "flash", "cudnn", "sdpa-flash", "flex", "sdpa")


def timed(fn, device):
    """fn() and its seconds: by CUDA events on a GPU (the kernels' time), else by the clock."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1000


def attention_reference(q, k, v, dout, lengths, window):
    """SDPA in float32 on each sequence alone, the window written out as a boolean mask -> out, [dq, dk, dv]."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    (left, right), outs, start = window, [], 0
    for n in lengths:
        i = torch.arange(n, device=q.device)
        offset = i[None, :] - i[:, None]  # (n, n) key position - query position
        ok = torch.ones(n, n, dtype=torch.bool, device=q.device)
        if left >= 0:
            ok &= offset >= -left
        if right >= 0:
            ok &= offset <= right
        x = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))  # (1, nh, n, hd)
        outs.append(F.scaled_dot_product_attention(*x, attn_mask=ok)[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), [x.grad for x in (q, k, v)]


def attention_kernels(config, case, lengths, device, dtype, steps, names):
    """Forward and backward of each kernel in `names` on each layer type (global, local) and mask (bidirectional,
    causal), median seconds of `steps` after two warm-ups (FlexAttention compiles in the first), on q, k, v of
    `dtype` for sequences of `lengths`; the error of its output and gradients against attention_reference; FLOP/s
    by support/flops.py's count (the pairs the mask keeps), the backward counted as 2 x the forward and, as
    FlashAttention's papers count it, 2.5 x. A kernel that cannot attend a cell says why."""
    T, nh, hd, S = sum(lengths), config.num_attention_heads, config.head_dim, max(lengths)
    cu = cu_seqlens_of(lengths).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for layer_type in ("global", "local"):
        for causal in (False, True):
            q, k, v, dout = (torch.randn(T, nh, hd, device=device, generator=g).to(dtype) for _ in range(4))
            no_kernel = dict.fromkeys(kernels.LAYER_TYPES)  # a Packing for its windows alone
            window = Packing(T, cu, S, causal, config.local_attention // 2, no_kernel).windows[layer_type]
            ref, ref_grads = attention_reference(q, k, v, dout, lengths, window)
            flops = 4 * nh * hd * sum(attention_pairs(n, *window) for n in lengths)  # forward
            for name in names:
                row = dict(case=case, layer=layer_type, causal=causal, backend=name, dtype=str(dtype)[6:])
                try:
                    row.update(attention_cell(name, q, k, v, dout, ref, ref_grads, flops, lengths, causal, layer_type,
                                              config, device, steps))
                except Exception as e:  # a kernel that fails here is a finding of the run, not its end
                    row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
                rows.append(row)
    return rows


def attention_cell(name, q, k, v, dout, ref, ref_grads, flops, lengths, causal, layer_type, config, device, steps):
    """One kernel on one cell of attention_kernels -> its columns."""
    packed = len(set(lengths)) == 1
    if name == "sdpa-flash":
        why = None if packed and layer_type == "global" else "takes no mask: no window, no documents kept apart"
    else:
        why = kernels.refusal(name, layer_type, device, q.dtype, 0.0, packed)
    forward_only = False
    if why is not None and name == "flex":  # FlexAttention on CPU: no backward
        with torch.no_grad():
            forward_only = kernels.refusal(name, layer_type, device, q.dtype, 0.0, packed) is None
    if why is not None and not forward_only:
        return {"note": why.removeprefix(f"attention backend {name!r} ")}
    backend = "sdpa" if name == "sdpa-flash" else name
    packing = Packing(sum(lengths), cu_seqlens_of(lengths).to(device), max(lengths), causal,
                      config.local_attention // 2, kernels.Choice({"global": backend, "local": backend}))
    times = []
    for i in range(steps + 2):
        x = [t.detach().requires_grad_(not forward_only) for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if name == "sdpa-flash" else contextlib.nullcontext():
            out, forward = timed(lambda: attention(*x, packing, layer_type, 0.0), device)
        backward = None if forward_only else timed(lambda: out.backward(dout), device)[1]
        times.append((forward, backward))
    forward = statistics.median(f for f, _ in times[2:])
    cols = {"fwd_ms": f"{1000 * forward:.3g}", "fwd_TFLOP/s": f"{flops / forward / 1e12:.3g}",
            "err": f"{((out.float() - ref).abs().max() / ref.abs().max()).item():.1e}"}
    if forward_only:
        return {**cols, "note": "forward only: no backward on CPU"}
    backward = statistics.median(b for _, b in times[2:])
    grad_err = max(((a.grad.float() - b).norm() / b.norm()).item() for a, b in zip(x, ref_grads))
    return {**cols, "bwd_ms": f"{1000 * backward:.3g}", "ms": f"{1000 * (forward + backward):.3g}",
            "bwd_TFLOP/s": f"{2 * flops / backward / 1e12:.3g}",
            "bwd_TFLOP/s_2.5x": f"{2.5 * flops / backward / 1e12:.3g}",
            "grad_err": f"{grad_err:.1e}"}


def matmul_flops(device, dtype, n=2048, runs=5):
    """FLOP/s of an (n x n) @ (n x n) matmul here: MFU's denominator where no datasheet peak is known."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for _ in range(runs + 1):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times[1:])


# -----------------------------------------------------------------------------
# 3. The LM loss's memory: full float32 logits against the chunked loss, one process per measurement

LOSS_CONFIG = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4, **SMALL_IDS)


def measure_loss_memory(spec):
    """One CLM forward + backward on 8 packed sequences of spec["seq_len"] tokens in its own process:
    the peak memory it adds, with the loss from full float32 logits (plain autograd)
    or chunked (model.cross_entropy_sum through forward, as train.py does)."""
    import torch.nn.functional as F

    device = torch.device(spec["device"])
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=spec["vocab"], **LOSS_CONFIG)).to(device)
    B, S = 8, spec["seq_len"]
    tokens = torch.randint(5, model.config.vocab_size, (B * S,), device=device)
    cu = torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device)
    rows = torch.arange(B * S, device=device).view(B, S)[:, :-1].flatten()  # every position with a next token
    targets = tokens[rows + 1]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    before = reset_peak_memory(device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        if spec["loss"] == "full_logits":
            logits = model(tokens, causal=True, cu_seqlens=cu, max_seqlen=S, rows=rows)
            loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        else:
            loss = model(tokens, causal=True, cu_seqlens=cu, max_seqlen=S, rows=rows, targets=targets)
    loss.backward()
    sync(device)
    seconds = time.perf_counter() - t0
    return {"peak_memory": peak_memory(device, before), "seconds": seconds, "loss": loss.item()}


# -----------------------------------------------------------------------------
# 4. Data: prepare against raw tiktoken, loader time per step


def data_throughput(text_path, tokenizer_path, seq_len, batch_size, workers):
    from data import Loader, mlm_batch, prepare, read_documents
    from support.tokenizer import load_tokenizer

    docs = list(read_documents([text_path]))
    tok = load_tokenizer(tokenizer_path)
    out = {}
    if tok.tiktoken is not None:  # the same vocabulary as a bare tiktoken Encoding, no added tokens, no remap
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            n = sum(map(len, tok.tiktoken.encode_ordinary_batch(docs)))
            times.append(time.perf_counter() - t0)
        out["raw_tiktoken_tokens_per_s"] = n / statistics.median(times)
    with tempfile.TemporaryDirectory() as tmp:
        for w in workers:
            t0 = time.perf_counter()
            meta = prepare(lambda: iter(docs), tokenizer_path, os.path.join(tmp, f"w{w}"), val_docs=100, workers=w)
            out[f"prepare_{w}_workers_tokens_per_s"] = (meta["train_tokens"] + meta["val_tokens"]) / (
                time.perf_counter() - t0)
        loader = Loader(os.path.join(tmp, f"w{workers[0]}"), "train", seq_len, batch_size, data_seed=0)
        special = {k: meta[k] for k in ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")}
        times = []
        for i in range(20):
            t0 = time.perf_counter()
            mlm_batch(loader.next(), 0.3, special, meta["vocab_size"], seed=[0, i])
            times.append(time.perf_counter() - t0)
        out["loader_ms_per_batch"] = 1000 * statistics.median(times)
    return out


# -----------------------------------------------------------------------------
# 5. The largest micro batch that fits, one process per objective


def largest_batch(spec):
    """The largest number of seq_len sequences (up to spec["cap"]) whose training step (forward, backward, AdamW,
    section 1's dtype, train.py's dropout) fits: one step per probe, an out-of-memory caught; from a linear fit of
    the peaks of the probes that fit (peak ~ fixed + per sequence x b: the b that fills 97% of the GPU), else by
    doubling, then bisection. -> that b, with every probe's (b, peak bytes or None, seconds)."""
    import dataclasses
    import gc

    device = torch.device(spec["device"])
    config = dataclasses.replace(SIZES[spec["size"]], attn_out_dropout=0.1)
    with device:
        model = ModernBertForMaskedLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if device.type == "cuda" else {}))
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rng = np.random.default_rng(0)

    def probe(b):
        before, started = reset_peak_memory(device), time.time()
        try:
            x = make_inputs([spec["seq_len"]] * b, config.vocab_size, spec["objective"], device, rng)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["dtype"] == "bfloat16"):
                loss = model(x["tokens"], causal=spec["objective"] == "clm", cu_seqlens=x["cu"],
                             max_seqlen=x["max_len"], rows=x["rows"], targets=x["targets"]) / x["targets"].numel()
            loss.backward()
            opt.step()
            sync(device)
            peak = peak_memory(device, before)
        except torch.OutOfMemoryError:
            peak = None
        except RuntimeError as e:  # cuBLAS and some kernels report a failed allocation in their own words
            if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e) and "out of memory" not in str(e):
                raise
            peak = None
        opt.zero_grad(set_to_none=True)  # outside the except: its frames, holding the step's tensors, are gone
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [b, peak, round(time.time() - started, 2)]

    fits, fails, probes, b = 0, spec["cap"] + 1, [], 1
    while fits + 1 < fails and len(probes) < 12:
        probes.append(probe(b))
        fits, fails = (b, fails) if probes[-1][1] is not None else (fits, b)
        ok = [(x, p) for x, p, _ in probes if p is not None]
        guess = 2 * fits
        if total and len(ok) >= 2:
            (b1, p1), (b2, p2) = ok[-2:]
            guess = int(b2 + (0.97 * total - p2) // max((p2 - p1) / (b2 - b1) if b2 != b1 else p2 / b2, 1))
        b = guess if fits < guess < fails else (fits + fails) // 2
    return {"largest": fits, "probes": probes, "total_memory": total}


# -----------------------------------------------------------------------------
# share: a CPU run beside busy processes, against its fair share of the machine (support/threads.py's reason)

SPIN = "import os\nfor _ in range({}):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass"  # N, one group


def timed_run(cmd, env):
    """-> (wall seconds, the CPUs it kept busy: its CPU time / wall, the CPU threads its start-up line names)."""
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    threads = re.search(r"(\d+) CPU threads? \(", r.stdout)
    return wall, cpu / wall, threads[1] if threads else "-"


def share(args, device, dtype):
    """`train.py configs/demo.py --tokens=N` timed whole, as a user waits for it, alone ("quiet") and beside --busy
    processes that spin a core each ("loaded"), --runs times each in turn: as is, and with each --variant's environment
    added ("NAME=VALUE[,NAME=VALUE]", ":quiet" at its end for quiet runs only). C usable CPUs' threads among busy + C
    runnable ones get C / (busy + C) of the machine: fair = the quiet median as is x (busy + C) / C. With --apart the
    busy processes are another session's (another login's jobs), and where Linux's autogroup shares the CPUs between
    sessions first, fair = quiet x C / max(C - busy, C / 2)."""
    variants = {"as is": {}, **{v: dict(kv.split("=", 1) for kv in v.removesuffix(":quiet").split(","))
                                for v in args.variant}}
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    loads = ("quiet", "loaded")
    runs = {(name, load): [] for name in variants for load in loads}  # (seconds, CPUs busy, threads) per run
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run([sys.executable, "data.py", "--demo", "domain", "--tokenizer", "bpe:4096", "--out", data],
                       cwd=ROOT, check=True, capture_output=True)
        for r in range(args.runs):
            for load in loads:
                busy = None if load == "quiet" else subprocess.Popen(  # one process group, killed as one
                    [sys.executable, "-c", SPIN.format(args.busy - 1)], start_new_session=args.apart,
                    process_group=None if args.apart else 0)
                try:
                    for name, env in variants.items():
                        if load == "loaded" and name.endswith(":quiet"):
                            continue
                        cmd = [sys.executable, "train.py", "configs/demo.py", f"--data_dir={data}",
                               f"--out_dir={tmp}/run{sum(map(len, runs.values()))}", f"--tokens={args.tokens}",
                               "--log_interval=1000"]
                        runs[name, load].append(timed_run(cmd, {**base, **env}))
                        print(f"run {r + 1}/{args.runs} {load} {name}: {runs[name, load][-1][0]:.1f} s", flush=True)
                finally:
                    if busy:
                        os.killpg(busy.pid, signal.SIGKILL)
                        busy.wait()
    C = usable_cpus()
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = "on" if f.read().strip() == "1" else "off"
    except OSError:
        autogroup = "absent"
    per_quiet = C / max(C - args.busy, C / 2) if args.apart and autogroup == "on" else (args.busy + C) / C
    fair = statistics.median(s for s, _, _ in runs["as is", "quiet"]) * per_quiet
    spread = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"  # noqa: E731
    rows = []
    for name in variants:
        done = [load for load in loads if runs[name, load]]
        quiet, loaded = ([s for s, _, _ in runs[name, load]] for load in loads)
        rows.append({"variant": name, "threads (quiet / loaded)": " / ".join(runs[name, load][-1][2] for load in done),
                     "quiet s (min-max)": spread(quiet), "loaded s (min-max)": spread(loaded),
                     "loaded / fair (worst)": f"{statistics.median(loaded) / fair:.2f} ({max(loaded) / fair:.2f})"
                                              if loaded else "-",
                     "CPUs busy (quiet / loaded)": " / ".join(
                         f"{statistics.median(c for _, c, _ in runs[name, load]):.2f}" for load in done)})
    print(f"\nshare: `train.py configs/demo.py --tokens={args.tokens}`; {C} usable CPUs, {args.busy} busy processes "
          f"{'in a session of their own' if args.apart else 'in its session'} (autogroup {autogroup}): fair share "
          f"{fair:.1f} s ({per_quiet:.1f} x the quiet median as is); {args.runs} runs each")
    print(table(rows, list(rows[0])))
    return rows


# -----------------------------------------------------------------------------
# freeze: the step with frozen layers against none

FREEZE_CONFIG = dict(vocab_size=1024, hidden_size=384, intermediate_size=576, num_hidden_layers=22,
                     num_attention_heads=6, local_attention=64, **SMALL_IDS)  # Base's depth, half its width


def freeze(args, device, dtype):
    """CPU time of one training step (forward, backward, AdamW) on 4 x 128 CLM tokens, one thread, with nothing
    frozen and with layers 0-7 frozen as the paper's freeze runs (support/freeze.py: their weights compute no
    gradient). The two take their steps in turn, so that the machine's load hits them alike; CPU time, so that
    waiting for a core is not counted."""
    from data import clm_batch

    torch.set_num_threads(1)
    batch = clm_batch(torch.randint(3, 1024, (4, 128), generator=torch.Generator().manual_seed(0)), eos_id=2)
    models = {}
    for layers in ("", "0-7"):
        torch.manual_seed(0)
        model = ModernBertForMaskedLM(ModernBertConfig(**FREEZE_CONFIG))
        optimizer = torch.optim.AdamW(model.param_groups(0.0), lr=1e-3, foreach=True)  # every weight, as train.py
        Freeze(SimpleNamespace(freeze_layers=layers, freeze_phase="main", freeze_mode="exact"), model,
               ["main"]).enter(SimpleNamespace(name="main"))
        models[layers or "none"] = (model, optimizer)
    times = {name: [] for name in models}
    for k in range(args.warmup + args.steps):
        for name, (model, optimizer) in models.items():
            started = time.process_time()
            model(batch.tokens, causal=True, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen, rows=batch.rows,
                  targets=batch.targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if k >= args.warmup:
                times[name].append(time.process_time() - started)
    none = statistics.median(times["none"])
    rows = [{"frozen": name, "step_ms": f"{1000 * statistics.median(t):.1f}",
             "vs_none": f"{statistics.median(t) / none:.3f}"} for name, t in times.items()]
    print(f"\nfreeze: {FREEZE_CONFIG['num_hidden_layers']} layers x {FREEZE_CONFIG['hidden_size']}, 4 x 128 tokens "
          f"CLM, CPU, 1 thread; CPU time, median of {args.steps} steps each")
    print(table(rows, ["frozen", "step_ms", "vs_none"]))
    return rows


# -----------------------------------------------------------------------------
# finetune_memory: a fine-tuning step at the model's full context, by tokens per micro batch


def measure_finetune_memory(spec):
    """In its own process, two fine-tuning steps of the paper's batch (suite.PROTOCOL's 16 examples) at the model's
    full context: micro batches of at most spec["max_tokens"] tokens whose gradients add up to the batch's (what
    eval.py's --max_tokens does), then AdamW. -> the peak memory they add (AdamW's state included), the second
    step's seconds."""
    import torch.nn.functional as F

    from model import ModernBertForSequenceClassification

    device, B, S = torch.device(spec["device"]), suite.PROTOCOL["batch_size"], spec["seq_len"]
    torch.manual_seed(0)
    config = dataclasses.replace(SIZES[spec["size"]], max_position_embeddings=S, id2label={"0": "a", "1": "b"})
    model = ModernBertForSequenceClassification(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    ids, labels = torch.randint(5, config.vocab_size, (B, S), device=device), torch.arange(B, device=device) % 2
    per = max(1, spec["max_tokens"] // S)  # examples per micro batch
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    before = reset_peak_memory(device)
    for _ in range(2):  # the second step's time: the first allocates
        t0 = time.perf_counter()
        for i in range(0, B, per):
            n = min(per, B - i)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(ids[i:i + n].flatten(), cu_seqlens=cu_seqlens_of([S] * n).to(device), max_seqlen=S)
            (F.cross_entropy(logits.float(), labels[i:i + n], reduction="sum") / B).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
    return {"peak_memory": peak_memory(device, before), "seconds": time.perf_counter() - t0,
            "micro_batches": -(-B // per)}


def finetune_memory(args, device, dtype):
    """measure_finetune_memory for each --max_tokens, and for the whole batch in one forward."""
    B, S = suite.PROTOCOL["batch_size"], args.seq_len
    rows = []
    for budget in [*args.max_tokens, B * S]:
        r = run_worker(dict(task="finetune_memory", size=args.size, seq_len=S, max_tokens=budget, device=str(device),
                            dtype=dtype))
        rows.append({"max_tokens": f"{budget}{' (one batch)' if budget == B * S else ''}",
                     "micro_batches": r["micro_batches"], "peak_MiB": f"{r['peak_memory'] / 2 ** 20:,.0f}",
                     "seconds": f"{r['seconds']:.2f}", "raw": r})
    for row in rows:
        row["vs_one_batch"] = f"{row['raw']['peak_memory'] / max(rows[-1]['raw']['peak_memory'], 1):.2f}"
    config = SIZES[args.size]
    print(f"\nfinetune_memory: {B} examples x {S} tokens, {config.num_hidden_layers} x {config.hidden_size}, {dtype}; "
          f"peak {'allocated during' if device.type == 'cuda' else 'RSS added by'} two steps, AdamW's state included; "
          "the second step's seconds")
    print(table(rows, ["max_tokens", "micro_batches", "peak_MiB", "vs_one_batch", "seconds"]))
    return rows


# -----------------------------------------------------------------------------


def table(rows, columns):
    widths = [max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(r.get(c, "-")).ljust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8, help="sequences of seq_len per step (packed case)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="add ours under torch.compile to section 1 (auto: on CUDA only; on CPU compiling a "
                        "fresh process per case costs minutes)")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="the device's dense peak for MFU (0: known GPU "
                                                                  "from its name, else a measured matmul)")
    p.add_argument("--loss_runs", type=int, default=3, help="processes per loss in section 3 (the median is reported)")
    p.add_argument("--loss_seq_len", type=int, default=1024, help="section 3: 8 sequences of this many tokens")
    p.add_argument("--loss_vocab", type=int, default=50368, help="section 3: vocabulary size")
    p.add_argument("--hf_backend", default="auto", help="transformers' attn_implementation (auto: its best here)")
    p.add_argument("--lengths_from", help="a text file whose documents' token lengths make the variable batch")
    p.add_argument("--tokenizer", help="tokenizer.json for --lengths_from and the data section")
    p.add_argument("--cases", nargs="+", default=["variable", "packed"], choices=["variable", "packed"],
                   help="section 1's batches (tests/gpu_check.py runs one case and objective per process)")
    p.add_argument("--objectives", nargs="+", default=["mlm", "clm"], choices=["mlm", "clm"])
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="section 1's implementations (default: ours, ours "
                   "compiled where --compile is on, transformers); regional: each transformer block and the loss "
                   "compiled, the rest eager")
    p.add_argument("--attn_backends", nargs="+", default=["auto"], help="section 1: ours with each of these "
                   "attn_backend values, e.g. varlen (today's) global=cudnn,local=varlen")
    p.add_argument("--attn_sizes", nargs="+", choices=list(SIZES), help="section 2's heads (default: --size's)")
    p.add_argument("--attn_kernels", nargs="+", choices=ATTENTION_KERNELS, default=list(ATTENTION_KERNELS))
    p.add_argument("--skip", nargs="*", default=[], choices=["step", "attention", "loss", "data"])
    p.add_argument("--out", default="bench.json")
    p.add_argument("--largest", type=int, metavar="CAP", help="section 5: the largest micro batch of seq_len "
                   "sequences, up to CAP, whose training step fits (a GPU's question: on CPU the cap is the answer)")
    p.add_argument("--profile", metavar="DIR", help="profile one more training step of ours (compiled where it "
                   "is) per case and objective: DIR/profile_CASE_OBJECTIVE.txt, its 30 costliest kernels (CPU: ops)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("section", nargs="?", choices=["share", "freeze", "finetune_memory"],
                   help="run this section alone, instead of sections 1-4 (see above)")
    p.add_argument("--busy", type=int, default=4, help="share: processes spinning one core each beside the loaded runs")
    p.add_argument("--runs", type=int, default=3, help="share: runs of each variant, quiet and loaded")
    p.add_argument("--tokens", type=int, default=60_000, help="share: the demo run's --tokens")
    p.add_argument("--apart", action="store_true", help="share: the busy processes in a session of their own")
    p.add_argument("--variant", action="append", default=[], help="share: NAME=VALUE[,NAME=VALUE][:quiet], an "
                   "environment added to the run (e.g. OMP_NUM_THREADS=2)")
    p.add_argument("--max_tokens", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="finetune_memory: tokens per micro batch, each against the whole batch in one forward")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps({"step": measure_step, "loss_memory": measure_loss_memory,
                          "largest": largest_batch, "finetune_memory": measure_finetune_memory}[spec["task"]](spec)))
        return

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    config = SIZES[args.size]
    if args.section:  # run alone
        results = {"settings": vars(args), args.section: {"share": share, "freeze": freeze,
                                                          "finetune_memory": finetune_memory}[args.section](
            args, device, dtype)}
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"\nwrote {args.out}")
        return
    hf_backend = args.hf_backend
    if hf_backend == "auto":
        try:
            import flash_attn  # noqa: F401
            hf_backend = "flash_attention_2" if device.type == "cuda" and dtype == "bfloat16" else "sdpa"  # bf16 only
        except ImportError:
            hf_backend = "sdpa"
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"({torch.get_num_threads()} threads), {dtype}, torch {torch.__version__}; model {args.size}: "
          f"{config.num_hidden_layers} x {config.hidden_size}, vocab {config.vocab_size}; seq_len {args.seq_len}, "
          f"{args.batch_size} sequences per packed step")
    results = {"settings": {**vars(args), "device_name": str(device), "dtype": dtype, "hf_backend": hf_backend}}
    failed = []  # section 1's workers that failed
    lengths_from = None
    if args.lengths_from:
        from data import read_documents
        from support.tokenizer import load_tokenizer
        tok = load_tokenizer(args.tokenizer)
        lengths_from = [len(x) + 2 for x in tok.encode_batch(list(read_documents([args.lengths_from]))[:20000])]

    if "step" not in args.skip:
        peak, peak_source = peak_flops(device, args.peak_tflops), "datasheet"
        if peak is None:
            peak = matmul_flops(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
            peak_source = "a 2048^3 matmul measured here"
        impls = []  # (row name, implementation, its attention, compile: None, "whole" or "regional")
        for name in args.impls or ["ours"] + (["ours compiled"] if compile_ else []) + ["transformers"]:
            who, _, how = name.partition(" ")
            mode = {"": None, "compiled": "whole", "regional": "regional"}[how]
            backends = args.attn_backends if who == "ours" else [hf_backend]
            impls += [(name if len(backends) == 1 else f"{name} [{b}]", who, b, mode) for b in backends]
        ours = [i for i in impls if i[1] == "ours"]
        profiled = next((i[0] for i in ours if i[3]), ours[0][0] if ours else None)  # compiled where it is
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
        with tempfile.TemporaryDirectory() as ckpt:
            torch.manual_seed(0)
            ModernBertForMaskedLM(config).save_pretrained(ckpt)  # the same weights for all
            lengths_file = None
            if lengths_from:
                lengths_file = os.path.join(ckpt, "lengths.npy")
                np.save(lengths_file, np.array(lengths_from))
            rows = []
            for case in args.cases:
                for objective in args.objectives:
                    measured = {}
                    for name, who, backend, mode in impls:
                        spec = dict(task="step", name=name, impl=who, backend=backend, ckpt=ckpt, device=str(device),
                                    dtype=dtype, compile=mode, case=case, objective=objective,
                                    seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps,
                                    warmup=args.warmup, lengths_from=lengths_file)
                        if args.profile and name == profiled:
                            spec["profile"] = os.path.join(args.profile, f"profile_{case}_{objective}.txt")
                        try:
                            r = measured[name] = run_worker(spec)
                        except SystemExit as e:  # the other rows still count; the exit status says it at the end
                            print(e, file=sys.stderr)
                            failed.append(f"{case} {objective} {name}")
                            continue
                        # One line per worker, before the table: a run cut at its time limit keeps what finished.
                        print(f"  {case} {objective} {name}: {r['tokens_per_s']:,.0f} tok/s, "
                              f"{1000 * r['seconds']:.1f} ms/step, MFU {100 * r['flops_per_s'] / peak:.1f}%, "
                              f"warm-up {r['warmup_seconds']:.1f} s"
                              + ("" if r["compiles"] is None else f", {r['compiles']} graphs"), flush=True)
                    hf = measured.get("transformers") or measured.get("transformers compiled")
                    for name, r in measured.items():
                        rows.append({"case": case, "objective": objective, "impl": name,
                                     "pad_%": f"{100 * (1 - r['tokens'] / r['padded_tokens']):.0f}",
                                     "tok/s": f"{r['tokens_per_s']:,.0f}",
                                     "vs_transformers": f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-",
                                     "MFU": f"{100 * r['flops_per_s'] / peak:.1f}%",
                                     "MFU_6N": f"{100 * r['convention_flops_per_s'] / peak:.1f}%",
                                     "mem_MiB": f"{r['peak_memory'] / 2 ** 20:,.0f}",
                                     "mem_vs_transformers": f"{r['peak_memory'] / max(hf['peak_memory'], 1):.2f}"
                                     if hf else "-", "warmup_s": f"{r['warmup_seconds']:.1f}",
                                     "compiles": "-" if r["compiles"] is None else r["compiles"], "raw": r})
        print(f"\n1. Training step (forward + backward + AdamW), median of {args.steps} steps; transformers with "
              f"attn_implementation={hf_backend} (CLM: bidirectional, it has no causal mask); memory: peak "
              f"{'allocated during' if device.type == 'cuda' else 'RSS added by'} the timed steps; MFU = training_flops "
              f"(real sequence lengths) / step time / {peak / 1e12:,.3g} TFLOP/s ({peak_source}); MFU_6N: the usual "
              f"6N + 12LHQT count (support/flops.convention_flops, T = seq_len) instead; warmup_s: the warm-up steps, "
              f"compiling included; compiles: graphs torch.compile made over warm-up and timed steps")
        print(table(rows, ["case", "objective", "impl", "pad_%", "tok/s", "vs_transformers", "MFU", "MFU_6N", "mem_MiB",
                           "mem_vs_transformers", "warmup_s", "compiles"]))
        results["step"] = rows
        results["peak_flops"] = {"flops": peak, "source": peak_source}

    if "attention" not in args.skip:
        rng = np.random.default_rng(0)
        cases = {"packed": batch_lengths("packed", args.batch_size, args.seq_len, rng, None),
                 "variable": batch_lengths("variable", args.batch_size, args.seq_len, rng,
                                           np.array(lengths_from) if lengths_from else None)}
        rows = []
        for size in args.attn_sizes or [args.size]:
            for case in args.cases:
                rows += [{"size": size, **r} for r in attention_kernels(
                    SIZES[size], case, cases[case], device, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                    args.steps, args.attn_kernels)]
                print(f"  attention {size} {case}: done", flush=True)
        print(f"\n2. Attention alone, forward and backward: packed = {args.batch_size} x {args.seq_len} tokens, "
              f"variable = {len(cases['variable'])} documents kept apart, {sum(cases['variable'])} tokens; median of "
              f"{args.steps} ({'CUDA events' if device.type == 'cuda' else 'wall clock'}); TFLOP/s of the pairs the "
              "mask keeps (support/flops.py), the backward counted as 2 x the forward and as 2.5 x (FlashAttention's "
              "papers); err: max |out - ref| / max |ref|, grad_err: the worst of |dq, dk, dv - ref| / |ref|, ref: SDPA "
              "in float32")
        print(table(rows, ["size", "case", "layer", "causal", "backend", "dtype", "fwd_ms", "bwd_ms", "fwd_TFLOP/s",
                           "bwd_TFLOP/s", "bwd_TFLOP/s_2.5x", "err", "grad_err", "note"]))
        results["attention"] = rows

    if "loss" not in args.skip:
        rows = []
        for loss in ("full_logits", "chunked"):
            runs = [run_worker(dict(task="loss_memory", loss=loss, device=str(device), dtype=dtype,
                                    seq_len=args.loss_seq_len, vocab=args.loss_vocab)) for _ in range(args.loss_runs)]
            rows.append({"loss": loss, "peak_memory": statistics.median(r["peak_memory"] for r in runs),
                         "seconds": statistics.median(r["seconds"] for r in runs), "loss_sum": runs[0]["loss"]})
        for r in rows:
            r.update(peak_MiB=f"{r['peak_memory'] / 2 ** 20:,.0f}", ms=f"{1000 * r['seconds']:,.0f}",
                     vs_full_logits=f"{r['peak_memory'] / rows[0]['peak_memory']:.2f}", value=f"{r['loss_sum']:.6g}")
        print(f"\n3. LM loss memory: one CLM forward + backward, vocab {args.loss_vocab}, 8 x {args.loss_seq_len} "
              f"tokens, hidden {LOSS_CONFIG['hidden_size']}, {LOSS_CONFIG['num_hidden_layers']} layers, {dtype}; peak "
              f"{'allocated during' if device.type == 'cuda' else 'RSS added by'} the step, median of {args.loss_runs} "
              f"processes each")
        print(table(rows, ["loss", "peak_MiB", "vs_full_logits", "ms", "value"]))
        results["loss_memory"] = rows

    if "data" not in args.skip and args.lengths_from and args.tokenizer:
        d = data_throughput(args.lengths_from, args.tokenizer, args.seq_len, args.batch_size, [1, 2])
        rows = [{"what": k, "value": f"{v:,.1f}"} for k, v in d.items()]
        if "raw_tiktoken_tokens_per_s" in d:
            for w in (1, 2):
                rows.append({"what": f"prepare {w} workers / raw tiktoken",
                             "value": f"{d[f'prepare_{w}_workers_tokens_per_s'] / d['raw_tiktoken_tokens_per_s']:.2f}"})
        ours = next((r for r in results.get("step", []) if (r["case"], r["objective"], r["impl"]) == (
            "packed", "mlm", "ours")), None)
        if ours:
            step_ms = 1000 * ours["raw"]["seconds"]
            rows.append({"what": "loader time / training step (packed MLM)",
                         "value": f"{d['loader_ms_per_batch'] / step_ms:.2%}"})
        print(f"\n4. Data ({args.lengths_from})")
        print(table(rows, ["what", "value"]))
        results["data"] = d

    if args.largest:
        rows = []
        for objective in args.objectives:
            r = run_worker(dict(task="largest", size=args.size, seq_len=args.seq_len, objective=objective,
                                cap=args.largest, device=str(device), dtype=dtype))
            peak = next((p for b, p, _ in r["probes"] if b == r["largest"]), None)
            rows.append({"objective": objective, "largest": r["largest"], "capped": r["largest"] == args.largest,
                         "peak_GiB": "-" if peak is None else f"{peak / 2 ** 30:.2f}", "probes": r["probes"],
                         "total_GiB": "-" if r["total_memory"] is None else f"{r['total_memory'] / 2 ** 30:.1f}"})
        print(f"\n5. The largest micro batch of {args.seq_len} tokens whose training step fits (eager, {dtype}, "
              f"up to {args.largest}); peak: allocated during its step")
        print(table(rows, ["objective", "largest", "capped", "peak_GiB", "total_GiB"]))
        results["largest"] = rows
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nwrote {args.out}")
    if failed:
        raise SystemExit(f"benchmark workers failed (their errors above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
