"""
The attention kernels behind model.attention(), fastest first, and which one a forward uses:

- flash-attn's `flash_attn_varlen_func` (pip install flash-attn --no-build-isolation): CUDA, float16/bfloat16;
- PyTorch's own `torch.nn.attention.varlen.varlen_attn` (2.10+, with `window_size`): CUDA, float16/bfloat16,
  no attention-probability dropout;
- SDPA, everywhere and in any dtype, per sequence or on a (B, S) view (SDPAView below).

"auto" takes the first that runs here; the config's attn_backend, or MODERNBERT_ATTN, forces one.
"""

import inspect
import os

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

BACKENDS = ("flash", "varlen", "sdpa")
# The fused kernels run on CUDA and take float16 / bfloat16 q, k, v only; a float32 forward attends with SDPA.
# tests/cpu_kernels.py sets KERNEL_DEVICE to "cpu" to run the kernels' real wrappers there on an emulated kernel.
KERNEL_DEVICE = "cuda"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def find_varlen_attn():
    """torch.nn.attention.varlen.varlen_attn if this PyTorch has it with a sliding window (2.10+), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn as fn
    except ImportError:
        return None
    return fn if "window_size" in inspect.signature(fn).parameters else None  # ModernBERT needs the window


# Looked up where CUDA is, once: its module imports torch._dynamo, seconds at every start of a CPU run.
varlen_attn = find_varlen_attn() if torch.cuda.is_available() else None


def compiler(setting, device):
    """train.py's `compile` -> the torch.compile backend its steps run, or None (eager). "auto": inductor on CUDA,
    eager on CPU (where inductor builds C++ for minutes); True: inductor; or a backend's name: "aot_eager" traces
    and guards as inductor does without generating code, which tells a compiler's bug from the model's."""
    named = {"auto": "inductor" if device.type == "cuda" else None, "true": "inductor", "false": None}
    return named.get(setting.lower(), setting)


def compile_model(model, backend="inductor"):
    """torch.compile(model), as train.py and bench.py run it. Inductor's Triton fusion of LayerNorm backward's two
    reductions (torch 2.10+) guards by default on the sizes it fuses, the MLM head's row count among them: a new
    mask rate (30% -> 15%) recompiled the whole model (H200, torch 2.11). Non-strict, it guards on none."""
    import torch._inductor.config as inductor
    if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):
        inductor.triton.mix_order_reduction_non_strict_mode = True
    return torch.compile(model, backend=backend)


def pick_backend(requested, device, dtype, dropout_p):
    """The backend of a forward on `device` with q, k, v of `dtype`: MODERNBERT_ATTN, else `requested`, else
    ("auto") the fastest one that runs here. A backend that cannot run here is refused, saying why."""
    name = os.environ.get("MODERNBERT_ATTN") or requested
    here = device.type == KERNEL_DEVICE
    if name == "auto":
        if here and dtype in KERNEL_DTYPES and flash_attn_varlen_func is not None:
            return "flash"
        if here and dtype in KERNEL_DTYPES and varlen_attn is not None and dropout_p == 0.0:
            return "varlen"
        return "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if name == "flash" and (flash_attn_varlen_func is None or not here):
        raise RuntimeError("attention backend 'flash' needs CUDA and `pip install flash-attn --no-build-isolation`")
    if name == "varlen" and (varlen_attn is None or not here):
        raise RuntimeError("attention backend 'varlen' needs CUDA and a PyTorch whose "
                           "torch.nn.attention.varlen.varlen_attn has window_size (2.10+)")
    if name != "sdpa" and dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"attention backend {name!r} takes float16 or bfloat16 q, k, v, but this forward runs "
                           f"in {dtype}: run it under bf16 autocast (--dtype=bfloat16) or use attn_backend 'auto' or "
                           "'sdpa'")
    if name == "varlen" and dropout_p > 0:
        raise RuntimeError("attention backend 'varlen' has no attention-probability dropout; "
                           "set attention_dropout=0 (use attn_out_dropout) or pick another backend")
    return name


class SDPAView:
    """SDPA over the sequences of an unpadded batch, in one of three ways. Sequences of one length (packed windows)
    are one (B, nh, S, hd) batch, only reshaped. Sequences of different lengths attend each alone on CPU, so that
    attention costs sum(L^2) rather than B * S^2 (with lengths as uneven as documents', many times less); on a GPU,
    or under torch.compile (where a loop over the lengths would recompile for every batch), on a (B, S) view
    zero-padded by a scatter, with a padding mask. Every other op stays on the flat tokens. A (T, T) block-diagonal
    mask would instead make CPU attention quadratic in the whole batch's token count."""

    def __init__(self, cu_seqlens, max_seqlen, positions, windows):
        lengths = cu_seqlens.diff()  # (B,)
        B, S, T, dev = lengths.numel(), max_seqlen, positions.numel(), cu_seqlens.device
        self.B, self.S = B, S
        each = dev.type == "cpu" and not torch.compiler.is_compiling()  # a GPU would launch B kernels per layer
        self.mode = "batch" if T == B * S else "each" if each else "padded"
        idx = torch.arange(S, device=dev)
        offset = idx[None, :] - idx[:, None]  # (S, S): key position - query position
        if self.mode == "each":
            self.bounds = cu_seqlens.tolist()
        if self.mode == "padded":
            seq = torch.repeat_interleave(torch.arange(B, device=dev), lengths, output_size=T)  # (T,)
            self.index = seq * S + positions  # (T,) each token's row in the (B * S) view
            real = idx[None, :] < lengths[:, None]  # (B, S)
        self.masks = {}  # layer type -> (boolean mask or None, is_causal)
        for layer_type, (left, right) in windows.items():
            if left < 0 and self.mode != "padded":  # full attention: no mask, so that SDPA picks its fast kernels
                self.masks[layer_type] = (None, right == 0)
                continue
            ok = torch.ones(S, S, dtype=torch.bool, device=dev)
            if left >= 0:
                ok &= offset >= -left
            if right >= 0:
                ok &= offset <= right
            if self.mode == "padded":  # keys must be real tokens; a pad query sees every key (no NaN), then dropped
                ok = ((ok & real[:, None, :]) | ~real[:, :, None])[:, None]  # (B, 1, S, S)
            self.masks[layer_type] = (ok, False)

    def __call__(self, q, k, v, layer_type, dropout_p):
        """(T, nh, hd) q, k, v -> (T, nh, hd)."""
        T, nh, hd = q.shape
        mask, is_causal = self.masks[layer_type]
        if self.mode == "each":
            def attend(start, end):  # one sequence: (L, nh, hd) -> (1, nh, L, hd) -> (L, nh, hd)
                L = end - start
                out = F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1)[None] for x in (q, k, v)),
                                                     attn_mask=None if mask is None else mask[:L, :L],
                                                     dropout_p=dropout_p, is_causal=is_causal)
                return out[0].transpose(0, 1)
            return torch.cat([attend(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:])])

        def view(x):  # (T, nh, hd) -> (B, nh, S, hd)
            if self.mode == "padded":
                x = x.new_zeros(self.B * self.S, nh, hd).index_copy(0, self.index, x)
            return x.view(self.B, self.S, nh, hd).transpose(1, 2)

        out = F.scaled_dot_product_attention(view(q), view(k), view(v), attn_mask=mask, dropout_p=dropout_p,
                                             is_causal=is_causal)
        out = out.transpose(1, 2).reshape(self.B * self.S, nh, hd)
        return out[self.index] if self.mode == "padded" else out
