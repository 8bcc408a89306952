"""
Throughput and memory of this ModernBERT against transformers' ModernBertForMaskedLM (same config, weights, device,
dtype and batches, in the same run), each attention kernel alone, and the largest micro batch that fits.

    python bench.py                                                              # CPU, a small config, minutes
    python bench.py --size base --seq_len 8192 --batch_size 4 [--profile prof]   # GPU: Base, packed 8192, bf16
    python bench.py --size base --seq_len 8192 --batch_size 4 --skip step --attn_sizes base large   # attention
    python bench.py --size base --seq_len 8192 --batch_size 4 --impls "ours compiled" "ours regional" \
        "transformers compiled" --attn_backends varlen global=cudnn,local=varlen    # today's kernels vs others
    python bench.py --size base --seq_len 8192 --batch_size 4 --largest 64 --skip step attention
    python bench.py --size base --seq_len 8192 --batch_size 4 --cases packed --objectives mlm finetune --skip attention

Each section prints a table (and bench.json has them): 1. the training step (forward, backward, AdamW), a process
per row: ours eager, compiled (on CUDA by default) or regional, and transformers' eager or compiled, on variable-
length (log-normal) and packed batches, MLM (transformers with sparse_prediction) and CLM (transformers has no causal
mask: bidirectional), its MFU by support/flops.py's count and by the usual 6N + 12LHQT; and fine-tuning (objective
finetune): eval.py's step, a classifier on the protocol's 16 sentences, its tokens/s against the packed training row's
of its implementation (vs_training); 2. attention alone, forward and backward, each kernel on each layer type,
bidirectional and causal, against SDPA in float32; 3. with --largest CAP, the largest micro batch up to CAP whose
step fits. Times are torch.utils.benchmark's medians. One-off measurements (threads beside busy processes, frozen
layers, fine-tuning memory, the chunked loss, data throughput) keep their figures in results/cpu-2026-11-28/README.md.
"""

import argparse
import ctypes
import dataclasses
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

from model import Flat, ModernBertConfig, ModernBertForMaskedLM, ModernBertForSequenceClassification, Packing, \
    attention, cu_seqlens_of
from support import kernels, suite
from support.flops import attention_pairs, convention_flops, peak_flops, training_flops
from support.hf import load_config

SMALL_IDS = dict(pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)  # inside small vocabs
SIZES = {
    "tiny": ModernBertConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                             num_attention_heads=2, **SMALL_IDS),
    "small": ModernBertConfig(vocab_size=8192, hidden_size=256, intermediate_size=384, num_hidden_layers=6,
                              num_attention_heads=4, **SMALL_IDS),
    "base": ModernBertConfig(),  # 22 x 768, vocab 50368
    "large": ModernBertConfig.large(),  # 28 x 1024
}
IMPLS = ("ours", "ours compiled", "ours regional", "transformers", "transformers compiled")  # regional: block by block
TRAINING = ("mlm", "clm")  # the objectives of a training step; "finetune" is eval.py's step (ours only)
ATTENTION_KERNELS = ("varlen", "flash", "cudnn", "sdpa")  # model.py's, called as a layer calls them


def median_seconds(stmt, min_time, **names):
    """torch.utils.benchmark's median seconds of `stmt` (it synchronizes the GPU), at this process's thread count."""
    timer = Timer(stmt, globals=names, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_time).median


def memory_from_now(device):
    """Start a peak-memory measurement -> the function that ends it: CUDA's peak allocated bytes, or on CPU the peak
    resident bytes added (glibc first gives back what it keeps for reuse, Linux's high-water mark is reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return lambda: torch.cuda.max_memory_allocated(device)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM
    before = status_kib("VmRSS:")
    return lambda: 1024 * (status_kib("VmHWM:") - before)


def status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


# -----------------------------------------------------------------------------
# 1. The training step, one (implementation, case, objective) per process


def batch_lengths(case, batch_size, seq_len, rng):
    """Packed: batch_size sequences of seq_len. Variable: documents of log-normal lengths (median seq_len / 6), about
    half as many tokens in all. Task: fine-tuning's batch, the protocol's examples, of a sentence's length (log-normal,
    median 40 tokens: NCBI-disease's and GAD's sentences), in one micro batch (eval.py's budget holds them)."""
    if case == "packed":
        return [seq_len] * batch_size
    if case == "task":
        return [min(max(int(rng.lognormal(np.log(40), 0.5)), 8), seq_len) for _ in range(suite.PROTOCOL["batch_size"])]
    lengths = []
    while sum(lengths) < batch_size * seq_len * 0.5:
        lengths.append(min(max(int(rng.lognormal(np.log(seq_len / 6), 0.9)), 8), seq_len))
    return lengths


def make_inputs(lengths, vocab, objective, device, rng):
    """The batch in both forms: padded ids, mask, labels (transformers); flat tokens, cu_seqlens, target rows (ours)."""
    B, S = len(lengths), max(lengths)
    ids, mask = torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n], mask[b, :n] = torch.from_numpy(rng.integers(5, vocab, n)), 1
    labels = torch.full((B, S), -100)
    if objective == "mlm":
        chosen = torch.from_numpy(rng.random((B, S)) < 0.3) & mask.bool()
        labels[chosen] = ids[chosen]
    else:  # next token wherever there is one
        labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], -100)
    flat = Flat.of(ids, mask)
    flat_labels = labels.flatten()[flat.keep]
    rows = (flat_labels != -100).nonzero().squeeze(1)
    x = dict(ids=ids, mask=mask, labels=labels, tokens=flat.tokens, cu=flat.cu_seqlens, rows=rows,
             targets=flat_labels[rows], classes=torch.arange(B) % 2)  # classes: fine-tuning's, one per sequence
    return {**{k: v.to(device) for k, v in x.items()}, "max_len": S, "lengths": lengths}


def load_model(spec):
    """The shared weights as the implementation runs them: ours (fine-tuning: with a classifier), or transformers'."""
    if spec["impl"] == "ours":
        ours = ModernBertForSequenceClassification if spec["objective"] == "finetune" else ModernBertForMaskedLM
        return ours.from_pretrained(spec["ckpt"], attn_backend=spec["backend"])
    import transformers
    return transformers.ModernBertForMaskedLM.from_pretrained(
        spec["ckpt"], attn_implementation=spec["backend"], sparse_prediction=spec["objective"] != "clm")


def measure_step(spec):
    """In its own process: the shared weights, warm-up (compiled: on every batch, so the timed steps run graphs
    compiled already), then the timed steps -> tokens/s, FLOP/s in both counts, peak memory, graphs compiled."""
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    config = load_config(ModernBertConfig, spec["ckpt"])  # ours, for the FLOPs of either implementation
    rng, ours, causal = np.random.default_rng(0), spec["impl"] == "ours", spec["objective"] == "clm"
    # Fine-tuning: eval.py's step, the checkpoint with a classifier, its loss, its AdamW; compiled, dynamo's own dynamic
    # sizes from the warm-up's second batch on (eval.py's DYNAMIC has them from the first): the same timed graph.
    finetune = spec["objective"] == "finetune"
    torch.manual_seed(0)
    model = load_model(spec)
    model = (model.place(device, dtype) if ours else model.to(device)).train()
    fused = {"fused": True} if device.type == "cuda" and not finetune else {}  # eval.py's AdamW: torch's default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    step_fn = kernels.compile_model(model, regional=spec["compile"] == "regional") if spec["compile"] else model
    batches = [make_inputs(batch_lengths(spec["case"], spec["batch_size"], spec["seq_len"], rng),
                           config.vocab_size, spec["objective"], device, rng) for _ in range(3)]

    def step(x):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if finetune:  # as eval.py: the batch's cross-entropies summed, over its examples (float32)
                logits = step_fn(x["tokens"], cu_seqlens=x["cu"], max_seqlen=x["max_len"]).float()
                loss = F.cross_entropy(logits, x["classes"], reduction="sum") / len(x["lengths"])
            elif ours:  # as train.py: the chunked loss, through forward
                loss = step_fn(x["tokens"], causal=causal, cu_seqlens=x["cu"], max_seqlen=x["max_len"], rows=x["rows"],
                               targets=x["targets"]) / x["targets"].numel()
            else:
                loss = step_fn(input_ids=x["ids"], attention_mask=x["mask"], labels=x["labels"]).loss
        loss.backward()
        if finetune:
            loss.item()  # eval.py reads each micro batch's loss: a sync (train.py reads none)
        opt.step()
        opt.zero_grad(set_to_none=True)

    started = time.perf_counter()  # one span, compiling included: the timing itself is torch.utils.benchmark's
    for i in range(max(spec["warmup"], len(batches) if spec["compile"] else 0)):
        step(batches[i % len(batches)])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    warmup, peak = time.perf_counter() - started, memory_from_now(device)  # the timed steps' own memory
    seconds = median_seconds("step(next(xs))", spec["min_time"], step=step, xs=itertools.cycle(batches))
    peak = peak()
    # The FLOPs each implementation has to do: transformers' ModernBERT runs CLM bidirectionally.
    flops = np.mean([training_flops(config, x["lengths"], causal and ours, 0 if finetune else x["targets"].numel())
                     for x in batches])  # fine-tuning: the classifier's head, on one row a sequence, left out
    n_params, tokens = sum(p.numel() for p in model.parameters()), np.mean([sum(x["lengths"]) for x in batches])
    if spec.get("profile"):  # one more step under the profiler: where its time goes
        with torch.profiler.profile() as prof:  # the CPU's activity, and CUDA's where there is CUDA
            step(batches[0])
        by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(spec["profile"], "w") as f:
            f.write(f"{spec['name']}, {spec['case']} {spec['objective']}, one step of {tokens:.0f} tokens; step median "
                    f"{seconds * 1000:.1f} ms\n{prof.key_averages().table(sort_by=by, row_limit=30)}")
    from torch._dynamo.utils import counters  # every graph dynamo compiled, recompilations included
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "flops_per_s": flops / seconds,
            "convention_flops_per_s": convention_flops(config, n_params, tokens, spec["seq_len"]) / seconds,
            "warmup_seconds": warmup, "peak_memory": peak, "compiles": counters["stats"]["unique_graphs"] if spec[
                "compile"] else None, "padded_tokens": np.mean([x["ids"].numel() for x in batches])}


def run_worker(spec):
    """measure_step or largest_batch (spec["task"]) in a fresh process: python bench.py --worker SPEC."""
    r = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    if r.returncode != 0:
        raise SystemExit(f"benchmark worker failed: {spec}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def step_rows(args, config, device, dtype, impls, peak):
    """A worker per (case, objective, implementation), a line each as it finishes (a run cut at its time limit keeps
    those), then the rows, each against transformers' of its case, fine-tuning's against the packed training row's of
    its implementation. -> (rows, the failed ones)."""
    rows, failed = [], []
    pairs = [(c, o) for c, o in itertools.product(args.cases, args.objectives) if o in TRAINING] + [
        ("task", "finetune")] * ("finetune" in args.objectives)

    def vs_training(name, r):  # against its implementation's first packed training row: the base's step, as train.py's
        trained = next((t["raw"] for t in rows if t["impl"] == name and t["case"] == "packed"), None)
        return f"{r['tokens_per_s'] / trained['tokens_per_s']:.2f}x" if trained else "-"

    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        ModernBertForMaskedLM(config).save_pretrained(ckpt)  # the same weights for all
        profiled = next((name for name, who, _, mode in sorted(impls, key=lambda i: not i[3])  # compiled first
                         if who == "ours"), None)
        for case, objective in pairs:
            measured = {}
            for name, who, backend, mode in impls:
                if objective == "finetune" and who != "ours":
                    continue
                spec = dict(task="step", name=name, impl=who, backend=backend, ckpt=ckpt, device=str(device),
                            dtype=dtype, compile=mode, case=case, objective=objective, seq_len=args.seq_len,
                            batch_size=args.batch_size, min_time=args.min_time, warmup=args.warmup,
                            profile=args.profile and name == profiled and os.path.join(
                                args.profile, f"profile_{case}_{objective}.txt"))
                try:
                    r = measured[name] = run_worker(spec)
                except SystemExit as e:  # the other rows still count; the exit status says it at the end
                    print(e, file=sys.stderr)
                    failed.append(f"{case} {objective} {name}")
                    continue
                print(f"  {case} {objective} {name}: {r['tokens_per_s']:,.0f} tok/s, {1000 * r['seconds']:.1f} "
                      f"ms/step, MFU {100 * r['flops_per_s'] / peak:.1f}%, warm-up {r['warmup_seconds']:.1f} s"
                      + ("" if r["compiles"] is None else f", {r['compiles']} graphs"), flush=True)
            hf = measured.get("transformers") or measured.get("transformers compiled")
            vs = lambda key, r: f"{r[key] / max(hf[key], 1e-9):.2f}" if hf else "-"  # noqa: E731
            rows += [dict(case=case, objective=objective, impl=name, raw=r, **{
                "pad_%": f"{100 * (1 - r['tokens'] / r['padded_tokens']):.0f}", "tok/s": f"{r['tokens_per_s']:,.0f}",
                "vs_transformers": vs("tokens_per_s", r) + "x" * bool(hf),
                "vs_training": vs_training(name, r) if objective == "finetune" else "-",
                "MFU": f"{100 * r['flops_per_s'] / peak:.1f}%",
                "MFU_6N": f"{100 * r['convention_flops_per_s'] / peak:.1f}%",
                "mem_MiB": f"{r['peak_memory'] / 2 ** 20:,.0f}", "mem_vs_transformers": vs("peak_memory", r),
                "warmup_s": f"{r['warmup_seconds']:.1f}", "compiles": "-" if r["compiles"] is None else r["compiles"]})
                for name, r in measured.items()]
    return rows, failed


def step_section(args, config, device, dtype, hf_backend):
    """Section 1's implementations, rows and table -> (bench.json's keys, the failed rows)."""
    peak, source = peak_flops(device, args.peak_tflops), "datasheet"
    if peak is None:
        a = torch.randn(2048, 2048, device=device, dtype=getattr(torch, dtype))
        peak, source = 2 * 2048 ** 3 / median_seconds("a @ a", 0.5, a=a), "a 2048^3 matmul measured here"
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    impls = []  # (row name, implementation, its attention, compile: "", "compiled" or "regional")
    for name in args.impls or ["ours"] + (["ours compiled"] if compile_ else []) + ["transformers"]:
        who, _, how = name.partition(" ")
        backends = args.attn_backends if who == "ours" else [hf_backend]
        impls += [(name if len(backends) == 1 else f"{name} [{b}]", who, b, how) for b in backends]
    os.makedirs(args.profile or ".", exist_ok=True)
    rows, failed = step_rows(args, config, device, dtype, impls, peak)
    print(f"\n1. Training step (forward, backward, AdamW), median; transformers with {hf_backend}; memory: peak "
          f"{'allocated' if device.type == 'cuda' else 'RSS added'} in the timed steps; MFU: support/flops.py's "
          f"FLOPs, MFU_6N: 6N + 12LHQT (T = seq_len), over {peak / 1e12:,.3g} TFLOP/s ({source}); warmup_s: compile; "
          "task finetune: eval.py's step on 16 sentences, vs_training: its tok/s over its impl's packed training row's")
    print(table(rows, ["case", "objective", "impl", "pad_%", "tok/s", "vs_transformers", "vs_training", "MFU", "MFU_6N",
                       "mem_MiB", "mem_vs_transformers", "warmup_s", "compiles"]))
    return dict(step=rows, peak_flops={"flops": peak, "source": source}), failed


# -----------------------------------------------------------------------------
# 2. Attention alone: each kernel on each layer type, against SDPA in float32


def attention_reference(q, k, v, dout, lengths, window):
    """SDPA in float32 on each sequence alone, the window as a boolean mask -> out, [dq, dk, dv]."""
    q, k, v = (x.detach().float().requires_grad_() for x in (q, k, v))
    outs = []
    for start, n in zip(np.cumsum([0, *lengths[:-1]]), lengths):
        offset = torch.arange(n, device=q.device)[None, :] - torch.arange(n, device=q.device)[:, None]  # key - query
        ok = kernels.window_mask(offset, *window)
        x = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))  # (1, nh, n, hd)
        outs.append(F.scaled_dot_product_attention(*x, attn_mask=ok)[0].transpose(0, 1))
    out = torch.cat(outs)
    out.backward(dout.float())
    return out.detach(), [x.grad for x in (q, k, v)]


def attention_section(args, device, dtype):
    """Each kernel on each layer type and mask: its error against attention_reference, its TFLOP/s by the pairs the
    mask keeps (support/flops.py), the backward counted 2 x the forward and 2.5 x (FlashAttention's papers' count)."""
    rng, rows, dtype = np.random.default_rng(0), [], getattr(torch, dtype)
    cases = {case: batch_lengths(case, args.batch_size, args.seq_len, rng) for case in ("packed", "variable")}
    for size, case, layer_type, causal in itertools.product(args.attn_sizes or [args.size], args.cases,
                                                            ("global", "local"), (False, True)):
        config, lengths = SIZES[size], cases[case]
        T, nh, hd, S = sum(lengths), config.num_attention_heads, config.head_dim, max(lengths)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, dout = (torch.randn(T, nh, hd, device=device, generator=g).to(dtype) for _ in range(4))
        packing = lambda backend: Packing(  # noqa: E731
            T, cu_seqlens_of(lengths).to(device), S, causal, config.local_attention // 2,
            kernels.Choice({"global": backend, "local": backend}))
        window = packing(None).windows[layer_type]
        ref = attention_reference(q, k, v, dout, lengths, window)
        flops = 4 * nh * hd * sum(attention_pairs(n, *window) for n in lengths)  # forward
        for name in args.attn_kernels:
            row = dict(size=size, case=case, layer=layer_type, causal=causal, backend=name, dtype=str(dtype)[6:])
            try:
                row.update(attention_cell(name, (q, k, v, dout), ref, flops, packing, layer_type, case == "packed",
                                          args.min_time))
            except Exception as e:  # a kernel that fails here is a finding of the run, not its end
                row["note"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}"
            rows.append(row)
    print(f"\n2. Attention alone: packed = {args.batch_size} x {args.seq_len}, variable = {len(cases['variable'])} "
          f"documents kept apart, {sum(cases['variable'])} tokens; medians; err, grad_err: max |out - ref| / max |ref|,"
          " max over dq, dk, dv of |d - ref| / |ref|, ref = SDPA in float32")
    print(table(rows, ["size", "case", "layer", "causal", "backend", "dtype", "fwd_ms", "bwd_ms", "fwd_TFLOP/s",
                       "bwd_TFLOP/s", "bwd_TFLOP/s_2.5x", "err", "grad_err", "note"]))
    return {"attention": rows}


def attention_cell(name, qkvd, ref, flops, packing, layer_type, packed, min_time):
    """One kernel on one cell of the attention section -> its columns, or a note saying why it cannot attend there."""
    q, k, v, dout = qkvd
    if why := kernels.refusal(name, layer_type, q.device, q.dtype, 0.0, packed):
        return {"note": why.removeprefix(f"attention backend {name!r} ")}
    x, packing = [t.detach().requires_grad_() for t in (q, k, v)], packing(name)
    run = lambda: attention(*x, packing, layer_type, 0.0)  # noqa: E731
    out = run()
    forward = median_seconds("run()", min_time, run=run)
    cols = {"fwd_ms": f"{1000 * forward:.3g}", "fwd_TFLOP/s": f"{flops / forward / 1e12:.3g}",
            "err": f"{((out.float() - ref[0]).abs().max() / ref[0].abs().max()).item():.1e}"}
    out.backward(dout)
    grad_err = max(((a.grad.float() - b).norm() / b.norm()).item() for a, b in zip(x, ref[1]))
    backward = median_seconds("run().backward(dout)", min_time, run=run, dout=dout) - forward
    return {**cols, "bwd_ms": f"{1000 * backward:.3g}", "bwd_TFLOP/s": f"{2 * flops / backward / 1e12:.3g}",
            "bwd_TFLOP/s_2.5x": f"{2.5 * flops / backward / 1e12:.3g}", "grad_err": f"{grad_err:.1e}"}


# -----------------------------------------------------------------------------
# 3. The largest micro batch that fits, one process per objective


def largest_batch(spec):
    """The largest number of seq_len sequences (up to spec["cap"]) whose training step (train.py's dropout) fits: a
    step per probe, an out-of-memory caught; the next b from a linear fit of the peaks that fit (the b that fills 97%
    of the GPU), else doubling, then bisection. -> that b, with every probe's (b, peak bytes or None)."""
    device = torch.device(spec["device"])
    config = dataclasses.replace(SIZES[spec["size"]], attn_out_dropout=0.1)
    with device:
        model = ModernBertForMaskedLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if device.type == "cuda" else {}))
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    rng = np.random.default_rng(0)

    def probe(b):
        peak = memory_from_now(device)
        try:
            x = make_inputs([spec["seq_len"]] * b, config.vocab_size, spec["objective"], device, rng)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec["dtype"] == "bfloat16"):
                loss = model(x["tokens"], causal=spec["objective"] == "clm", cu_seqlens=x["cu"],
                             max_seqlen=x["max_len"], rows=x["rows"], targets=x["targets"]) / x["targets"].numel()
            loss.backward()
            opt.step()
            peak = peak()
        except RuntimeError as e:  # torch.OutOfMemoryError; cuBLAS and some kernels say it in their own words
            if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e) and "out of memory" not in str(e):
                raise
            peak = None
        opt.zero_grad(set_to_none=True)  # outside the except: its frames, holding the step's tensors, are gone
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return [b, peak]

    fits, fails, probes, b = 0, spec["cap"] + 1, [], 1
    while fits + 1 < fails and len(probes) < 12:
        probes.append(probe(b))
        fits, fails = (b, fails) if probes[-1][1] is not None else (fits, b)
        ok = [(x, p) for x, p in probes if p is not None]
        guess = 2 * fits
        if total and len(ok) >= 2:
            (b1, p1), (b2, p2) = ok[-2:]
            guess = int(b2 + (0.97 * total - p2) // max((p2 - p1) / (b2 - b1) if b2 != b1 else p2 / b2, 1))
        b = guess if fits < guess < fails else (fits + fails) // 2
    return {"largest": fits, "probes": probes, "total_memory": total}


def largest_section(args, device, dtype):
    rows = []
    for objective in [o for o in args.objectives if o in TRAINING]:
        r = run_worker(dict(task="largest", size=args.size, seq_len=args.seq_len, objective=objective, cap=args.largest,
                            device=str(device), dtype=dtype))
        peak = next((p for b, p in r["probes"] if b == r["largest"]), None)
        rows.append({"objective": objective, "largest": r["largest"], "capped": r["largest"] == args.largest,
                     "peak_GiB": "-" if peak is None else f"{peak / 2 ** 30:.2f}", "probes": r["probes"],
                     "total_GiB": "-" if r["total_memory"] is None else f"{r['total_memory'] / 2 ** 30:.1f}"})
    print(f"\n3. The largest micro batch of {args.seq_len} tokens whose training step fits (eager, {dtype}, up to "
          f"{args.largest}); peak: allocated during its step")
    print(table(rows, ["objective", "largest", "capped", "peak_GiB", "total_GiB"]))
    return {"largest": rows}


def table(rows, columns):
    widths = [max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(str(r.get(c, "-")).ljust(w) for c, w in zip(columns, widths)) for r in rows])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=8, help="sequences of seq_len per step (packed case)")
    p.add_argument("--min_time", type=float, default=2.0, help="seconds each measurement times (the median reported)")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing (compiled: each of the 3 batches)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bfloat16 on GPU")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on for CUDA")
    p.add_argument("--cases", nargs="+", default=["variable", "packed"], choices=["variable", "packed"])
    p.add_argument("--objectives", nargs="+", default=[*TRAINING, "finetune"], choices=[*TRAINING, "finetune"])
    p.add_argument("--hf_backend", default="auto", help="transformers' attn_implementation (auto: sdpa or FA2)")
    p.add_argument("--peak_tflops", type=float, default=0.0, help="the GPU's dense bf16 peak, if it is not known")
    p.add_argument("--impls", nargs="+", choices=IMPLS, help="default: ours (compiled too on CUDA), transformers")
    p.add_argument("--attn_backends", nargs="+", default=["auto"], help="ours with each: global=cudnn,local=varlen")
    p.add_argument("--attn_sizes", nargs="+", choices=list(SIZES), help="section 2's heads (default: --size's)")
    p.add_argument("--attn_kernels", nargs="+", choices=ATTENTION_KERNELS, default=list(ATTENTION_KERNELS))
    p.add_argument("--skip", nargs="*", default=[], choices=["step", "attention"])
    p.add_argument("--largest", type=int, metavar="CAP", help="section 3 up to CAP sequences (CPU: the cap fits)")
    p.add_argument("--profile", metavar="DIR", help="profile a step of ours: DIR/profile_CASE_OBJECTIVE.txt")
    p.add_argument("--out", default="bench.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        return print(json.dumps({"step": measure_step, "largest": largest_batch}[spec["task"]](spec)))
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype, config = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32"), \
        SIZES[args.size]
    hf_backend = args.hf_backend if args.hf_backend != "auto" else "flash_attention_2" if (
        kernels.flash_attn_varlen_func and device.type == "cuda" and dtype == "bfloat16") else "sdpa"  # bf16 only
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} "
          f"({torch.get_num_threads()} threads), {dtype}, torch {torch.__version__}; model {args.size}: "
          f"{config.num_hidden_layers} x {config.hidden_size}, vocab {config.vocab_size}; seq_len {args.seq_len}, "
          f"{args.batch_size} sequences per packed step")
    results, failed = {"settings": {**vars(args), "dtype": dtype, "hf_backend": hf_backend}}, []
    if "step" not in args.skip:
        step, failed = step_section(args, config, device, dtype, hf_backend)
        results.update(step)
    if "attention" not in args.skip:
        results.update(attention_section(args, device, dtype))
    if args.largest:
        results.update(largest_section(args, device, dtype))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(f"\nwrote {args.out}")
    if failed:
        raise SystemExit(f"benchmark workers failed (their errors above): {', '.join(failed)}")


if __name__ == "__main__":
    main()
