"""
The attention kernels behind model.attention(), and which one each layer type ("global", "local") uses:

- flash-attn's `flash_attn_varlen_func` (pip install flash-attn --no-build-isolation): CUDA, float16/bfloat16;
- PyTorch's `torch.nn.attention.varlen.varlen_attn` (2.10+, with `window_size`): CUDA, float16/bfloat16, no dropout;
- SDPA's cuDNN kernel: CUDA, float16/bfloat16, on the (B, nh, S, hd) view of a packed batch with no mask (SDPAView),
  so the global layers of packed batches only: under a window's or documents' mask it would compute every pair;
- FlexAttention with a block mask of documents and windows (FlexView): CUDA, or CPU without a backward; no dropout;
- SDPA, everywhere and in any dtype, per sequence or on a (B, S) view (SDPAView).

"auto" takes, per layer type, the first of AUTO that runs here on the batch; attn_backend, or MODERNBERT_ATTN, forces
one for all layers ("varlen") or one per layer type ("global=cudnn,local=varlen").
"""

import contextlib
import functools
import inspect
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None

BACKENDS = ("flash", "varlen", "cudnn", "flex", "sdpa")
LAYER_TYPES = ("global", "local")
# "auto", per layer type: the first of these that runs here. bench.py's attention section on an H200 (torch 2.11,
# results/h200-2026-11-27/call3), forward + backward at 4 x 8192: the global layers of packed batches, cuDNN 6.7 ms
# bidirectional and 3.9 causal against varlen_attn's 11.2 and 6.1 (FlashAttention-2; FlexAttention 15.0 and 8.8).
# Documents kept apart (cuDNN has no bounds for them) and the local layers: varlen_attn, 1.6-2.4x ahead of Flex.
AUTO = {"global": ("cudnn", "flash", "varlen", "sdpa"), "local": ("flash", "varlen", "sdpa")}
# The fused kernels run on CUDA and take float16 / bfloat16 q, k, v only; a float32 forward attends with SDPA.
# tests/cpu_kernels.py sets KERNEL_DEVICE to "cpu" to run the kernels' real wrappers there on an emulated kernel.
KERNEL_DEVICE = "cuda"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
SDPA_KERNELS = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "sdpa": None}  # the kernels SDPA may choose from (None: any)
CUDNN = torch.backends.cudnn.is_available() and torch.version.hip is None  # NVIDIA's cuDNN (ROCm's "cudnn" is MIOpen)
FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys: a block mask says which (query, key) blocks to visit


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


def compile_model(model, backend="inductor", regional=False):
    """torch.compile(model), as train.py and bench.py run it. Inductor's fusion of LayerNorm backward's reductions
    (torch 2.10+) guards by default on the sizes it fuses, the MLM head's row count among them (a new mask rate
    recompiled the whole model, H200, torch 2.11): non-strict, it guards on none. regional: compile each block in
    place, and the head with its chunked loss, the rest eager: a graph per kind of block (the first, global, local)
    whatever the depth, a shorter warm-up (on CPU, documents kept apart are attended one by one inside the blocks: a
    graph per set of lengths). AOTAutograd's cache, which a resume reads, takes the chunked loss's
    autograd.Function only when allowed: it is traced into the graph that keys the cache, so safe (pytorch#194007:
    DDP's graph and SDPA restricted to a kernel still miss it)."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor
    if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):
        inductor.triton.mix_order_reduction_non_strict_mode = True
    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):  # torch 2.7+
        functorch.autograd_cache_allow_custom_autograd_functions = True
    if regional:
        for block in model.model.layers:
            block.compile(backend=backend)
        model.cross_entropy_sum = torch.compile(model.cross_entropy_sum, backend=backend)
    else:
        model = torch.compile(model, backend=backend)
    model.register_forward_pre_hook(dynamic_rows, with_kwargs=True)  # run eagerly, before the compiled forward
    return model


def dynamic_rows(module, args, kwargs):
    """The rows that have a target, and their targets: one dynamic size, so that MLM's count of targets, new every
    step, reuses one graph."""
    for name in ("rows", "targets"):
        if kwargs.get(name) is not None:
            torch._dynamo.mark_dynamic(kwargs[name], 0)


class Choice(dict):
    """The backend of each layer type, {"global": name, "local": name}: printed as one name where they agree."""

    def __str__(self):
        return self["global"] if self["global"] == self["local"] else ", ".join(f"{t} {b}" for t, b in self.items())


def pick_backend(requested, device, dtype, dropout_p, packed=True):
    """The backend of each layer type in a forward on `device` with q, k, v of `dtype`, on a batch that is `packed`
    (every sequence max_seqlen long) or not: MODERNBERT_ATTN, else `requested`, one name for all layers or one per
    layer type ("global=cudnn,local=varlen"); "auto" takes the first of AUTO that runs here. A backend that cannot
    run here is refused, saying why."""
    name = os.environ.get("MODERNBERT_ATTN") or requested
    parts = [part.partition("=") for part in name.split(",")]
    asked = {t: b for t, _, b in parts} if "=" in name else dict.fromkeys(LAYER_TYPES, name)
    if sorted(asked) != sorted(LAYER_TYPES) or not set(asked.values()) <= {"auto", *BACKENDS}:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}, or one per "
                         "layer type, as global=cudnn,local=varlen")
    choice = Choice()
    for layer_type in LAYER_TYPES:
        options = AUTO[layer_type] if asked[layer_type] == "auto" else (asked[layer_type],)
        why = [refusal(b, layer_type, device, dtype, dropout_p, packed) for b in options]
        if None not in why:  # a forced backend ("auto" always ends in SDPA)
            raise RuntimeError(why[0])
        choice[layer_type] = options[why.index(None)]
    return choice


def refusal(name, layer_type, device, dtype, dropout_p, packed):
    """Why backend `name` cannot attend a layer of `layer_type` here; None where it can."""
    here = device.type == KERNEL_DEVICE
    if name == "flash" and (flash_attn_varlen_func is None or not here):
        return "attention backend 'flash' needs CUDA and `pip install flash-attn --no-build-isolation`"
    if name == "varlen" and (varlen_attn is None or not here):
        return ("attention backend 'varlen' needs CUDA and a PyTorch whose torch.nn.attention.varlen.varlen_attn has "
                "window_size (2.10+)")
    if name == "cudnn" and not (here and CUDNN):
        return "attention backend 'cudnn' (SDPA's cuDNN kernel) needs CUDA and a PyTorch built with NVIDIA's cuDNN"
    if name == "cudnn" and (layer_type == "local" or not packed):
        return ("attention backend 'cudnn' (SDPA's cuDNN kernel) attends the global layers of packed batches only: it "
                "has no window, and no bounds for documents kept apart; give it those alone (global=cudnn,local=varlen)"
                " or use 'auto'")
    if name in ("flash", "varlen", "cudnn") and dtype not in KERNEL_DTYPES:
        return (f"attention backend {name!r} takes float16 or bfloat16 q, k, v, but this forward runs in {dtype}: run "
                "it under bf16 autocast (--dtype=bfloat16) or use attn_backend 'auto' or 'sdpa'")
    if name in ("varlen", "flex") and dropout_p > 0:
        return (f"attention backend {name!r} has no attention-probability dropout; set attention_dropout=0 (use "
                "attn_out_dropout) or pick another backend")
    if name == "flex" and device.type == "cpu" and torch.is_grad_enabled():
        return ("attention backend 'flex' has no backward on CPU (torch's FlexAttention): use it on CUDA or without "
                "gradients")
    return None


class SDPAView:
    """SDPA over the sequences of an unpadded batch, for the layer types whose backend is "sdpa" or "cudnn" (packed
    global layers only: no mask). Sequences of one length (packed windows) are one (B, nh, S, hd) batch, only
    reshaped. Sequences of different lengths attend each alone on CPU (sum(L^2) rather than B * S^2); on a GPU, or
    under torch.compile (where a loop over the lengths would recompile for every batch), on a (B, S) view
    zero-padded by a scatter, with a padding mask. Every other op stays on the flat tokens."""

    def __init__(self, packing):
        cu_seqlens, positions = packing.cu_seqlens, packing.positions
        # The layer types that attend here -> the kernels SDPA may choose from
        self.kernels = {t: SDPA_KERNELS[b] for t, b in packing.backend.items() if b in SDPA_KERNELS}
        lengths = cu_seqlens.diff()  # (B,)
        B, S, T, dev = lengths.numel(), packing.max_seqlen, positions.numel(), cu_seqlens.device
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
        for layer_type in self.kernels:
            left, right = packing.windows[layer_type]
            if left < 0 and self.mode != "padded":  # full attention: no mask, so that SDPA picks its fast kernels
                self.masks[layer_type] = (None, right == 0)
                continue
            ok = window_mask(offset, left, right)
            if self.mode == "padded":  # keys must be real tokens; a pad query sees every key (no NaN), then dropped
                ok = ((ok & real[:, None, :]) | ~real[:, :, None])[:, None]  # (B, 1, S, S)
            self.masks[layer_type] = (ok, False)

    def __call__(self, q, k, v, layer_type, dropout_p):
        """(T, nh, hd) q, k, v -> (T, nh, hd)."""
        T, nh, hd = q.shape
        mask, is_causal = self.masks[layer_type]
        kernels = self.kernels[layer_type]

        def sdpa(q, k, v, mask):  # (B, nh, S, hd) each, on the layer type's kernels
            with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)

        if self.mode == "each":
            def attend(start, end):  # one sequence: (L, nh, hd) -> (1, nh, L, hd) -> (L, nh, hd)
                L = end - start
                out = sdpa(*(x[start:end].transpose(0, 1)[None] for x in (q, k, v)),
                           None if mask is None else mask[:L, :L])
                return out[0].transpose(0, 1)
            return torch.cat([attend(a, b) for a, b in zip(self.bounds[:-1], self.bounds[1:])])

        def view(x):  # (T, nh, hd) -> (B, nh, S, hd)
            if self.mode == "padded":
                x = x.new_zeros(self.B * self.S, nh, hd).index_copy(0, self.index, x)
            return x.view(self.B, self.S, nh, hd).transpose(1, 2)

        out = sdpa(view(q), view(k), view(v), mask).transpose(1, 2).reshape(self.B * self.S, nh, hd)
        return out[self.index] if self.mode == "padded" else out


def window_mask(offset, left, right):
    """offset: key position - query position -> True where the key is in the window (left, right); -1 is no bound."""
    return ((offset >= -left) | (left < 0)) & ((offset <= right) | (right < 0))


class FlexView:
    """FlexAttention over an unpadded batch as one (1, nh, T, hd) sequence, with a block mask per layer type. The keys
    a query sees are one interval, its sequence cut to the layer's window, so the mask is lo[q] <= k <= hi[q] for
    packed windows and documents kept apart alike, and the kernel visits only the (FLEX_BLOCK x FLEX_BLOCK) blocks of
    (query, key) pairs that some interval reaches: 2 or 3 key blocks per query block in a local layer."""

    def __init__(self, packing):
        cu_seqlens, positions = packing.cu_seqlens, packing.positions
        T = positions.numel()
        i = torch.arange(T, device=positions.device)
        first = i - positions  # (T,) the first token of each token's sequence
        last = torch.repeat_interleave(cu_seqlens[1:].long(), cu_seqlens.diff(), output_size=T) - 1  # (T,) its last
        self.masks = {}
        for layer_type in [t for t, b in packing.backend.items() if b == "flex"]:
            left, right = packing.windows[layer_type]
            lo = first if left < 0 else torch.maximum(first, i - left)
            hi = last if right < 0 else torch.minimum(last, i + right)
            self.masks[layer_type] = interval_block_mask(lo, hi, FLEX_BLOCK)

    def __call__(self, q, k, v, layer_type):
        """(T, nh, hd) q, k, v -> (T, nh, hd)."""
        flex = flex_attention
        if q.device.type == "cuda" and not torch.compiler.is_compiling():
            flex = compiled_flex()  # called eagerly, FlexAttention would compute all T x T scores, then mask them
        out = flex(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=self.masks[layer_type])  # (1, nh, T, hd)
        return out[0].transpose(0, 1)


def interval_block_mask(lo, hi, block):
    """FlexAttention's BlockMask of "query q sees keys lo[q] .. hi[q]" over T tokens, lo and hi (T,), in blocks of
    `block` queries and keys. A (query block, key block) pair is full where every query of the block sees every key
    of the block (the kernel skips the mask there), partial where some query sees some key (the kernel masks), else
    skipped."""
    T = lo.numel()
    n = -(-T // block)  # blocks, the last one possibly short
    lo, hi = F.pad(lo, (0, n * block - T), value=T), F.pad(hi, (0, n * block - T), value=-1)  # padding sees no key
    starts = torch.arange(0, n * block, block, device=lo.device)  # (n,) each key block's first key and last key
    ends = (starts + block - 1).clamp(max=T - 1)
    some = ((lo[:, None] <= ends) & (hi[:, None] >= starts)).view(n, block, n).any(1)  # (n query blocks, n key blocks)
    every = ((lo[:, None] <= starts) & (hi[:, None] >= ends)).view(n, block, n).all(1)

    def blocks(visit):  # (n, n) bool -> per query block, how many key blocks and which, those first: (1, 1, n, ...)
        order = visit.int().argsort(dim=-1, descending=True, stable=True)
        return visit.sum(-1, dtype=torch.int32)[None, None], order.int()[None, None]

    def mask_mod(b, h, q, k):
        return (lo[q] <= k) & (k <= hi[q])

    return BlockMask.from_kv_blocks(*blocks(some & ~every), *blocks(every), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(T, T))


@functools.cache
def compiled_flex():
    """torch.compile(flex_attention), made once, at its first eager use on CUDA (torch.compile imports dynamo)."""
    return torch.compile(flex_attention)
