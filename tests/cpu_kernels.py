"""The two GPU attention kernels' real Python wrappers, run on CPU down to the compiled kernel, emulated here:

- flash-attn 2.8.3, the real package from tests/.kernels (tests/install_kernels.sh; only this module puts it on
  sys.path, and where the environment has a flash-attn of its own the tests that need this copy skip). Its compiled
  extension `flash_attn_2_cuda` becomes `varlen_fwd` / `varlen_bwd` below (flash_api.cpp's arguments and returns),
  and its custom ops (declared for CUDA only) get their own Python bodies as CPU kernels.
- PyTorch's `varlen_attn`: CPU kernels for its custom ops `torch_attn::_varlen_attn` and `_varlen_attn_backward`.

The emulated kernel follows flash-attn's documentation: q, k, v (total, heads, head_dim) fp16 / bf16 with a contiguous
last dim; cu_seqlens int32; query i sees key j of its sequence when i - left <= j <= i + right (-1 = unlimited,
aligned bottom-right; causal sets right = 0; a window of max_seqlen_k or more is unlimited); it returns the
log-sum-exp (heads, total_q) float32 the backward recomputes the probabilities from. It computes in float32, has no
dropout, and raises where the GPU would be silently wrong (a max_seqlen shorter than a sequence).

`install(monkeypatch, backends)` gives support/kernels.py the real wrappers with "cpu" as the kernel device, so the
model selects its backend on CPU as on CUDA; `calls` records what the kernel received.
"""

import os
import sys
import types

import torch
from torch.nn.attention import SDPBackend
from torch.nn.attention.varlen import varlen_attn

from support import kernels  # first: the flash-attn it imports is the environment's, if it has one

HERE = os.path.dirname(os.path.abspath(__file__))

calls = {"flash": [], "varlen": []}


# -----------------------------------------------------------------------------
# The kernel, in float32


def check(q, k, v, cu_q, cu_k, max_q, max_k):
    """The kernel's TORCH_CHECKs on what model.py can send it, and the bound it does not check."""
    if q.device.type != "cpu":
        raise RuntimeError("tests/cpu_kernels.py emulates the kernels on CPU tensors only")
    for t, what in ((q, "q"), (k, "k"), (v, "v")):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"FlashAttention only support fp16 and bf16 data type ({what} is {t.dtype})")
        if t.dtype != q.dtype:
            raise RuntimeError("query and key must have the same dtype")
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if q.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if k.shape[1] != q.shape[1]:
        raise RuntimeError("emulation: no GQA")  # model.py never asks for it
    for cu, m, t in ((cu_q, max_q, q), (cu_k, max_k, k)):
        if cu.dtype != torch.int32 or not cu.is_contiguous():
            raise RuntimeError("cu_seqlens must have dtype int32 and be contiguous")
        lengths = cu.diff()
        if int(cu[0]) != 0 or int(cu[-1]) != t.shape[0] or bool((lengths < 0).any()):
            raise RuntimeError(f"cu_seqlens {cu.tolist()} does not cover the {t.shape[0]} tokens")
        if int(lengths.max()) > m:
            raise RuntimeError(f"max_seqlen {m} < longest sequence {int(lengths.max())} (silently wrong on GPU)")


def allowed(cu_q, cu_k, max_k, causal, left, right):
    """(total_q, total_k) bool: which keys each query sees."""
    if causal:
        right = 0
    left, right = (-1 if w >= max_k else w for w in (left, right))

    def seq_pos(cu):
        lengths = cu.diff().long()
        seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        return seq, torch.arange(seq.numel()) - cu[:-1].long()[seq], lengths[seq]

    (sq, iq, lq), (sk, jk, lk) = seq_pos(cu_q), seq_pos(cu_k)
    offset = jk[None, :] - iq[:, None] - (lk[None, :] - lq[:, None])  # key - query, aligned bottom-right
    return (sq[:, None] == sk[None, :]) & kernels.window_mask(offset, left, right)


def forward(q, k, v, ok, scale):
    """-> out (total_q, heads, hd) in q's dtype, lse (heads, total_q) float32."""
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    s = s.masked_fill(~ok, float("-inf"))
    lse = s.logsumexp(-1)  # (heads, total_q)
    p = (s - lse[..., None]).exp()
    return like(q, torch.einsum("hqk,khd->qhd", p, v.float())), lse


def like(x, result):
    """The kernels allocate their outputs with empty_like (x's strides where x is dense, else contiguous),
    as their fake registrations say: a compiled graph views them with those strides."""
    return torch.empty_like(x).copy_(result)


def backward(dout, q, k, v, out, lse, ok, scale):
    """-> dq, dk, dv in q's dtype and softmax_d = rowsum(dout * out) (heads, total_q) float32."""
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    p = (s.masked_fill(~ok, float("-inf")) - lse[..., None]).exp()  # the probabilities, from the saved lse
    d = (dof * out.float()).sum(-1).T  # (heads, total_q)
    ds = p * (torch.einsum("qhd,khd->hqk", dof, vf) - d[..., None])  # dS = P * (dO V^T - D)
    dq = torch.einsum("hqk,khd->qhd", ds, kf) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, qf) * scale
    dv = torch.einsum("hqk,qhd->khd", p, dof)
    return like(q, dq), like(k, dk), like(v, dv), d


# -----------------------------------------------------------------------------
# flash-attn: the compiled extension's two functions, as flash_api.cpp declares them


def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, gen_):
    check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    assert p_dropout == 0 and softcap == 0 and alibi_slopes is None and block_table is None and out_ is None
    ok = allowed(cu_seqlens_q, cu_seqlens_k, max_seqlen_k, is_causal, window_size_left, window_size_right)
    calls["flash"].append(dict(dtype=q.dtype, window=(window_size_left, 0 if is_causal else window_size_right),
                               causal=is_causal))  # what the kernel was asked, before the clipping
    out, lse = forward(q, k, v, ok, softmax_scale)
    # (out, softmax_lse, S_dmask, rng_state); S_dmask is empty without return_softmax
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, deterministic, gen_, rng_state):
    check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    ok = allowed(cu_seqlens_q, cu_seqlens_k, max_seqlen_k, is_causal, window_size_left, window_size_right)
    dq, dk, dv, d = backward(dout, q, k, v, out, softmax_lse, ok, softmax_scale)
    for buf, g in ((dq_, dq), (dk_, dk), (dv_, dv)):  # the wrapper passes its buffers; the kernel fills them
        buf.copy_(g)
    batch = cu_seqlens_q.numel() - 1  # softmax_d is (heads, total_q + 128 x batch), as the kernel pads it
    return dq_, dk_, dv_, torch.cat([d, d.new_zeros(d.shape[0], 128 * batch)], 1)


def install_flash():
    """The package from tests/.kernels with the emulated extension under it; CPU kernels for its custom ops.
    None where the environment has a working flash-attn: a GPU user's is left as it is (tests/test_gpu.py
    runs it on the GPU), and the tests that need this one skip."""
    if kernels.flash_attn_varlen_func is not None:
        return None
    sys.path.insert(0, os.path.join(HERE, ".kernels"))
    extension = types.ModuleType("flash_attn_2_cuda")
    extension.varlen_fwd, extension.varlen_bwd = varlen_fwd, varlen_bwd
    sys.modules["flash_attn_2_cuda"] = extension
    try:
        import flash_attn
    except ImportError:  # a collection error of the files that need it, with the fix, not an xdist INTERNALERROR
        raise ImportError("tests need flash-attn's Python package in tests/.kernels: "
                          "run bash tests/install_kernels.sh") from None
    from flash_attn import flash_attn_interface as fi
    assert flash_attn.__version__ == "2.8.3" and flash_attn.__file__.startswith(HERE), flash_attn.__file__
    for op in (fi._flash_attn_varlen_forward, fi._flash_attn_varlen_backward):
        op.register_kernel("cpu")(op._init_fn)  # the op's own body, which calls the extension
    return flash_attn.flash_attn_varlen_func


flash_attn_varlen_func = install_flash()
NO_FLASH = "flash-attn is installed here: the CPU emulation runs only its own copy (tests/install_kernels.sh)"


# -----------------------------------------------------------------------------
# torch varlen_attn: CPU kernels of its custom ops (under them, on CUDA, aten's copy of the same kernel)


@torch.library.register_kernel("torch_attn::_varlen_attn", "cpu")
def _varlen_attn_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                     window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)
    left, right = window_size or (-1, -1)
    ok = allowed(cu_seq_q, cu_seq_k, max_k, is_causal, left, right)
    calls["varlen"].append(dict(dtype=query.dtype, window=(left, 0 if is_causal else right), causal=is_causal))
    out, lse = forward(query, key, value, ok, scale if scale is not None else query.shape[-1] ** -0.5)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


@torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu")
def _varlen_attn_backward_cpu(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                              rng_state, scale=None, window_size=None):
    left, right = window_size or (-1, -1)
    ok = allowed(cu_seq_q, cu_seq_k, max_k, is_causal, left, right)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    return backward(grad_out, query, key, value, out, lse, ok, scale)[:3]


# -----------------------------------------------------------------------------


def install(monkeypatch, backends=("flash", "varlen")):
    """Make the model see the kernels on the CPU. backends: which of the two exist (as when flash-attn is,
    or is not, installed). cuDNN's attention, which "auto" gives the global layers of packed batches, is SDPA
    restricted to one kernel: here SDPA's CPU flash kernel stands in for it."""
    monkeypatch.setattr(kernels, "KERNEL_DEVICE", "cpu")
    monkeypatch.setitem(kernels.SDPA_KERNELS, "cudnn", [SDPBackend.FLASH_ATTENTION])
    monkeypatch.setattr(kernels, "CUDNN", True)  # as CUDA builds of PyTorch have it
    monkeypatch.setattr(kernels, "flash_attn_varlen_func", flash_attn_varlen_func if "flash" in backends else None)
    monkeypatch.setattr(kernels, "varlen_attn", varlen_attn if "varlen" in backends else None)
    monkeypatch.delenv("MODERNBERT_ATTN", raising=False)
    for v in calls.values():
        v.clear()
