"""
Liger-Kernel's fused Triton kernels against what the step runs now (model.py's own ops, fused by inductor), at Base's
shapes in one 4 x 8192 packed step, forward + backward, the same inputs for both, in the dtypes the step gives them
(bf16 autocast: weights and the residual stream float32, matmul outputs bfloat16):

- norm: the residual add and the LayerNorm after it (float32, no bias), s = x + r, y = LN(s); Liger has no fused add
  for LayerNorm (only for RMSNorm), so its row is the add in torch and LigerLayerNormFunction (a zero bias);
- GeGLU: gelu(a) * g on the halves of Wi's output; Liger's GEGLU is GELU's tanh form, ModernBERT's the exact (erf):
  at most 5e-4 apart, below bfloat16's rounding, so the error column cannot tell them apart;
- RoPE: q and k rotated out of the (T, 3, nh, hd) qkv rows; Liger's kernel rotates (1, nh, T, hd) views in place;
- loss: the decoder matmul and cross-entropy, summed (support/kernels.py's chunked loss against
  LigerFusedLinearCrossEntropyFunction, float32 accumulation), on CLM's rows (all) and MLM's (30% masked).

Liger's rows are what each kernel would cost dropped into model.py as it is, its glue included (the add, the copies of
non-contiguous views). Per piece: the median ms of a call (torch.utils.benchmark), and on CUDA the ms of its kernels
alone (the profiler's sum: host overhead is a large part of these sub-millisecond calls); the rate (of the kernels
where measured): GB/s for the bytes of the inputs and outputs read or written once each way (the H200's memory gives
4,800), TFLOP/s for the loss's three matmuls; and each one's largest error against a float64 formula on the same
inputs, over every output and gradient, relative to that tensor's largest value. A Base step runs the norm 46 times
(two per layer but the first, the embeddings', the final and the head's), GeGLU and RoPE 22 times, the loss once.

    python -m pip download --no-deps -d .whl liger-kernel==0.8.5             # here: .whl/ travels in the call's carry
    python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl  # there (torch brings triton)
    PYTHONPATH=/tmp/site python tests/liger.py --out liger.json              # or tests/gpu_check.py's part f

`--tiny` runs it at toy sizes, on CPU where there is no GPU: float32, ours with aot_eager, Liger's kernels under
Triton's interpreter, which runs its RoPE (triton 3.6: not its LayerNorm, GEGLU or loss; those rows say why).
"""

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import apply_rope, rope_cos_sin  # noqa: E402
from support.kernels import chunked_cross_entropy  # noqa: E402

BASE = dict(T=4 * 8192, H=768, I=1152, nh=12, V=50368)
TINY = dict(T=96, H=32, I=48, nh=2, V=100)
EPS = 1e-5


def pieces(sizes, device, low):
    """Each piece: its name, its inputs (float32, or `low`: the matmuls' output dtype), ours, Liger's, the float64
    formula, and its FLOPs (None: rated by its bytes)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction

    T, H, I, nh, V = (sizes[k] for k in ("T", "H", "I", "nh", "V"))
    hd = H // nh
    g = torch.Generator(device).manual_seed(0)
    rand = lambda *shape, dtype=low, scale=1.0: (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)  # noqa
    f32 = torch.float32
    zero_bias = torch.zeros(H, device=device)

    def ln64(x, r, w):
        s = x + r
        mu, var = s.mean(-1, keepdim=True), s.var(-1, unbiased=False, keepdim=True)
        return s, (s - mu) / torch.sqrt(var + EPS) * w

    def ours_norm(x, r, w):
        s = x + r
        return s, F.layer_norm(s, (H,), w, None, EPS)

    def liger_norm(x, r, w):
        s = x + r
        return s, LigerLayerNormFunction.apply(s, w, zero_bias, EPS)

    yield ("norm + residual", [rand(T, H, dtype=f32), rand(T, H), 1 + rand(H, dtype=f32, scale=0.1)], ours_norm,
           liger_norm, ln64, None)

    def geglu64(h):
        a, gate = h.chunk(2, dim=-1)
        return (0.5 * a * (1 + torch.erf(a / math.sqrt(2))) * gate,)

    yield ("GeGLU", [rand(T, 2 * I)], lambda h: (lambda a, gate: (F.gelu(a) * gate,))(*h.chunk(2, dim=-1)),
           lambda h: (LigerGELUMulFunction.apply(*h.chunk(2, dim=-1)),), geglu64, None)

    positions = torch.arange(T, device=device) % 8192
    cos, sin = rope_cos_sin(positions, hd, 160000.0).to(low)  # (T, hd) each, sin signed as apply_rope takes it
    plain_sin = torch.cat([sin[:, hd // 2:], sin[:, hd // 2:]], dim=-1)  # sin, sin: Liger applies rotate_half's sign

    def ours_rope(qkv):
        q, k = apply_rope(qkv.view(T, 3, nh, hd)[:, :2], cos, sin).unbind(dim=1)
        return q, k

    def liger_rope(qkv):
        qkv = qkv.view(1, T, 3, nh, hd)
        q, k = LigerRopeFunction.apply(qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), cos[None],
                                       plain_sin[None])  # (1, nh, T, hd) views of (1, T, nh, hd) rows
        return q.transpose(1, 2)[0], k.transpose(1, 2)[0]

    def rope64(qkv):
        x = qkv.view(T, 3, nh, hd)[:, :2]
        half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], dim=-1)
        out = x * cos[:, None, None].double() + half * plain_sin[:, None, None].double()
        return out[:, 0], out[:, 1]

    yield "RoPE (q, k)", [rand(T, 3 * H)], ours_rope, liger_rope, rope64, None

    weight, bias = rand(V, H, dtype=f32, scale=0.02), rand(V, dtype=f32, scale=0.02)
    for name, rows in (("loss, CLM rows", T), ("loss, MLM rows (30%)", int(0.3 * T))):
        targets = torch.randint(0, V, (rows,), generator=g, device=device)
        targets[::97] = -100  # the rows with nothing to predict (CLM: each document's last token)

        def ours_loss(x, w, b, targets=targets):  # max_rows: the batch's tokens, as the step passes it
            return (chunked_cross_entropy(x, w, b, targets, max_rows=T),)

        def liger_loss(x, w, b, targets=targets):
            return (LigerFusedLinearCrossEntropyFunction.apply(x, w, targets, b, None, -100, 0.0, 0.0, "sum", None,
                                                               False, torch.float32)[0],)

        def loss64(x, w, b, targets=targets):
            total = 0
            for i in range(0, x.shape[0], 4096):  # 4096 rows of float64 logits at a time (autograd keeps 8: 13 GB)
                total = total + F.cross_entropy(F.linear(x[i:i + 4096], w, b), targets[i:i + 4096], reduction="sum")
            return (total,)

        yield name, [rand(rows, H, dtype=f32), weight, bias], ours_loss, liger_loss, loss64, 6 * rows * H * V


def forward_backward(fn, inputs, grads, amp=contextlib.nullcontext()):
    """fn's outputs (forward under amp), and its inputs' gradients for these upstream gradients."""
    with amp:
        outs = fn(*inputs)
    return outs, torch.autograd.grad(outs, inputs, grads)


def upstream(outs, noise):
    """The upstream gradients of outs: the noise in each output's dtype, 1 for a scalar (the loss)."""
    return [torch.ones_like(o) if o.dim() == 0 else n.to(o.dtype) for o, n in zip(outs, noise)]


def largest_error(got, want):
    """The largest |got - want| over every tensor, relative to that tensor's largest |want|."""
    return max(((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, want))


def kernel_ms(step, calls=5):
    """The ms of the CUDA kernels of one step() call: the profiler's sum over `calls` calls."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def run(sizes, device, low, compile_backend, min_time):
    """Each piece's row, as it is measured."""
    amp = torch.autocast(device.type, dtype=low, enabled=low != torch.float32)
    for name, inputs, ours, liger, formula, flops in pieces(sizes, device, low):
        inputs = [t.requires_grad_() for t in inputs]
        exact = [t.detach().double().requires_grad_() for t in inputs]  # float64 leaves: their gradients stay float64
        outs = formula(*exact)
        noise = [torch.randn_like(o, dtype=torch.float32) for o in outs]  # the same upstream gradients for all three
        want = [o.detach() for o in outs] + list(torch.autograd.grad(outs, exact, upstream(outs, noise)))
        row = {"piece": name, "unit": "TFLOP/s" if flops else "GB/s"}
        for impl, fn in (("ours", torch.compile(ours, backend=compile_backend, dynamic=False)), ("liger", liger)):
            try:
                with amp:
                    outs = fn(*inputs)  # ours: compiles
                grads = upstream(outs, noise)
                got = [o.detach() for o in outs] + list(torch.autograd.grad(outs, inputs, grads))
                row[f"{impl}_error"] = largest_error(got, want)
                step = lambda: forward_backward(fn, inputs, grads, amp)  # noqa: E731
                seconds = Timer("step()", globals={"step": step}).blocked_autorange(min_run_time=min_time).median
                row[f"{impl}_ms"] = 1e3 * seconds
                if device.type == "cuda":
                    row[f"{impl}_kernel_ms"] = kernel_ms(step)
                    seconds = row[f"{impl}_kernel_ms"] / 1e3
                work = flops or 2 * sum(t.numel() * t.element_size() for t in inputs + list(outs))
                row[f"{impl}_rate"] = work / seconds / (1e12 if flops else 1e9)
            except Exception as e:  # one piece's failure (a kernel the interpreter lacks, an API change) keeps the rest
                row[f"{impl}_failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        row["timed"] = "kernel_ms" if "ours_kernel_ms" in row and "liger_kernel_ms" in row else "ms"  # CUDA: kernels'
        both = f"ours_{row['timed']}" in row and f"liger_{row['timed']}" in row
        row["ours_over_liger"] = row[f"ours_{row['timed']}"] / row[f"liger_{row['timed']}"] if both else None
        yield row


def cells(r):
    """A row's cells as the table shows them (ours / Liger's), timed as compared (CUDA: the kernels' own ms)."""
    cell = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
    both = lambda key, fmt: f"{cell(f'ours_{key}', fmt)} / {cell(f'liger_{key}', fmt)}"  # noqa: E731
    failed = "; ".join(f"{impl}: {r[f'{impl}_failed']}" for impl in ("ours", "liger") if f"{impl}_failed" in r)
    return {"piece": r["piece"], "ms (kernels)": f"{both('ms', '.3f')} ({both('kernel_ms', '.3f')})",
            "ours / liger": "-" if r["ours_over_liger"] is None else f"{r['ours_over_liger']:.2f}x",
            "rate": f"{both('rate', ',.0f')} {r['unit']}", "error vs float64": both("error", ".1e"), "failed": failed}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy sizes (on CPU where there is no GPU)")
    p.add_argument("--min_time", type=float, default=1.0, help="seconds each timing runs at least")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.tiny:
            sys.exit("no GPU here: Base's sizes are for an H200; --tiny runs the script at toy sizes on CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Liger's Triton kernels, interpreted on CPU tensors
    low = torch.bfloat16 if device.type == "cuda" else torch.float32  # bfloat16 is NaN in Triton's interpreter
    torch.backends.cuda.matmul.allow_tf32 = True  # as the step has it (support/processes.autocast)
    try:
        versions = {name: importlib.metadata.version(name) for name in ("torch", "triton", "liger-kernel")}
    except importlib.metadata.PackageNotFoundError as e:
        sys.exit(f"{e.name} is not installed: pip install liger-kernel (the docstring says how on the device)")
    sizes = TINY if args.tiny else BASE
    print(versions, torch.cuda.get_device_name() if device.type == "cuda" else "CPU", low, sizes)
    rows = []
    for row in run(sizes, device, low, "inductor" if device.type == "cuda" else "aot_eager", args.min_time):
        row["cells"] = cells(row)
        if not rows:
            print(f"| {' | '.join(row['cells'])} |\n|" + "---|" * len(row["cells"]))
        print(f"| {' | '.join(row['cells'].values())} |", flush=True)
        rows.append(row)
        if args.out:  # after each row, whole or not at all: a cut run keeps what it measured
            Path(f"{args.out}.tmp").write_text(json.dumps(dict(versions=versions, sizes=sizes, rows=rows), indent=1))
            os.replace(f"{args.out}.tmp", args.out)


if __name__ == "__main__":
    main()
