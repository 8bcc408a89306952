"""CPU stand-ins for the two GPU attention kernels, for the GPU-path harness (tests/test_gpu_path.py).

Each stand-in has the real function's signature, raises where the real kernel raises on the inputs
we could send it (the preconditions below are read from flash-attn 2.8's `flash_attn_varlen_func`
and PyTorch's `torch.nn.attention.varlen.varlen_attn` with the aten flash kernel under it), and
computes the documented result in float32, returned in the input dtype as the kernels do:

- q, k, v: (total_tokens, heads, head_dim), one dtype, float16 or bfloat16 only; last dim contiguous
  (varlen_attn passes them to aten as they are; flash-attn makes them contiguous itself);
  head_dim <= 256; k and v with the same heads as q (no GQA asked for).
- cu_seqlens: int32, 1-D, contiguous, on the tensors' device, from 0 to total_tokens, non-decreasing.
- max_seqlen: a Python int (varlen_attn is a custom op with an `int` argument), at least the longest
  sequence: the kernels size their grid with it and silently skip what lies beyond.
- window_size (left, right), -1 = unlimited: query i sees keys j of its own sequence with
  i - left <= j <= i + right. flash-attn's `causal=True` sets right = 0. varlen_attn has no `causal`:
  window_size == (-1, 0) is causal, and it compares the tuple, so a list would not be.

`install(monkeypatch)` puts both in model.py and makes "cpu" the kernel device, so the model
selects its backend on CPU exactly as it does on CUDA. `calls` records what each one received.
As a launcher, `python tests/fake_kernels.py SCRIPT ARGS...` runs a script of the project (also
under torchrun) with the stand-ins in place of the kernels named by FAKE_KERNELS (default both)
and prints what they received on exit.
"""

import atexit
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, run as a script

import torch  # noqa: E402

import model  # noqa: E402

calls = {"flash": [], "varlen": []}


def _check(name, q, k, v, cu_q, cu_k, max_q, max_k):
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"{name}: FlashAttention only supports fp16 and bf16 data type ({what} is {t.dtype})")
        if t.dtype != q.dtype:
            raise RuntimeError(f"{name}: query and {what} must have the same dtype")
        if t.dim() != 3:
            raise RuntimeError(f"{name}: {what} must be (total, heads, head_dim), got {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise RuntimeError(f"{name}: {what} must have contiguous last dimension")
        if t.device != q.device:
            raise RuntimeError(f"{name}: {what} is on {t.device}, query on {q.device}")
    if q.shape[-1] > 256:
        raise RuntimeError(f"{name}: FlashAttention forward only supports head dimension at most 256")
    if k.shape != v.shape or k.shape[1:] != q.shape[1:]:
        raise RuntimeError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    for cu, m, t in ((cu_q, max_q, q), (cu_k, max_k, k)):
        if cu.dtype != torch.int32:
            raise RuntimeError(f"{name}: cu_seqlens must have dtype int32, got {cu.dtype}")
        if cu.dim() != 1 or not cu.is_contiguous() or cu.device != q.device:
            raise RuntimeError(f"{name}: cu_seqlens must be a contiguous 1-D tensor on the query's device")
        if not isinstance(m, int) or isinstance(m, bool):
            raise TypeError(f"{name}: max_seqlen must be a Python int, got {type(m).__name__}")
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != t.shape[0] or bool((lengths < 0).any()):
            raise RuntimeError(f"{name}: cu_seqlens {cu.tolist()} does not cover the {t.shape[0]} tokens")
        if int(lengths.max()) > m:
            raise RuntimeError(f"{name}: max_seqlen {m} < longest sequence {int(lengths.max())} (silently wrong on GPU)")


def _attend(q, k, v, cu, left, right, scale, dropout_p):
    """Per sequence, in float32: softmax(q k^T * scale + window mask) v."""
    out = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[s:e].float().transpose(0, 1) for x in (q, k, v))  # (heads, L, hd)
        i = torch.arange(e - s)
        offset = i[None, :] - i[:, None]  # key - query
        ok = torch.ones(e - s, e - s, dtype=torch.bool)
        if left >= 0:
            ok &= offset >= -left
        if right >= 0:
            ok &= offset <= right
        scores = (qs @ ks.transpose(1, 2)) * scale
        p = scores.masked_fill(~ok, float("-inf")).softmax(-1)
        if dropout_p > 0:
            p = torch.nn.functional.dropout(p, dropout_p)
        out.append((p @ vs).transpose(0, 1))  # (L, heads, hd)
    return torch.cat(out).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _check("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("stand-in: self-attention only")
    left, right = window_size
    if causal:
        right = 0
    calls["flash"].append(dict(dtype=q.dtype, window=(left, right), causal=causal))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _attend(q, k, v, cu_seqlens_q, left, right, scale, dropout_p)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    _check("varlen_attn", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    if not torch.equal(cu_seq_q, cu_seq_k):
        raise NotImplementedError("stand-in: self-attention only")
    is_causal = window_size == (-1, 0)  # as varlen_attn decides it
    left, right = window_size
    if is_causal:
        right = 0
    calls["varlen"].append(dict(dtype=query.dtype, window=(left, right), causal=is_causal))
    return _attend(query, key, value, cu_seq_q, left, right, scale if scale is not None else query.shape[-1] ** -0.5,
                   0.0)


def install(monkeypatch, backends=("flash", "varlen")):
    """Make the model see these kernels on the CPU. backends: which of the two exist (as when
    flash-attn is, or is not, installed)."""
    monkeypatch.setattr(model, "KERNEL_DEVICE", "cpu")
    monkeypatch.setattr(model, "flash_attn_varlen_func", flash_attn_varlen_func if "flash" in backends else None)
    monkeypatch.setattr(model, "varlen_attn", varlen_attn if "varlen" in backends else None)
    monkeypatch.setattr(model, "varlen_looked_up", True)  # not torch's: the stand-in, or none
    monkeypatch.delenv("MODERNBERT_ATTN", raising=False)
    for v in calls.values():
        v.clear()


def _report():
    for name, seen in calls.items():
        dtypes = sorted({str(c["dtype"]).removeprefix("torch.") for c in seen})
        windows = sorted({c["window"] for c in seen})
        # One write per line: with PYTHONUNBUFFERED (as in CI) print() writes each piece separately, and two
        # ranks' lines on the same pipe could interleave; one write below PIPE_BUF bytes cannot.
        os.write(2, f"fake_kernels: {name} calls={len(seen)} dtypes={','.join(dtypes)} windows={windows}\n".encode())


if __name__ == "__main__":
    backends = os.environ.get("FAKE_KERNELS", "flash,varlen").split(",")
    model.KERNEL_DEVICE = "cpu"
    model.flash_attn_varlen_func = flash_attn_varlen_func if "flash" in backends else None
    model.varlen_attn = varlen_attn if "varlen" in backends else None
    model.varlen_looked_up = True
    atexit.register(_report)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
