"""
How model.py's costly ops run fast: attention kernels (chosen once), torch.compile's settings, the LM loss in chunks.

The attention kernels:
- flash-attn's `flash_attn_varlen_func` (pip install flash-attn --no-build-isolation): CUDA, float16/bfloat16;
- PyTorch's `torch.nn.attention.varlen.varlen_attn` (2.10+, with `window_size`): CUDA, float16/bfloat16, no dropout;
- SDPA's cuDNN kernel: CUDA, float16/bfloat16, on the (B, nh, S, hd) view of a packed batch with no mask (SDPAView),
  so the global layers of packed batches only: under a window's or documents' mask it would compute every pair;
- SDPA, everywhere and in any dtype, per sequence or on a (B, S) view (SDPAView).
choose() picks them once per device and dtype, as a script places the model, and the model holds its choice.
"""

import contextlib
import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
# PyTorch's varlen_attn where it has the sliding window ModernBERT needs (2.10+), else None. Looked up where CUDA is
# only: its module imports torch._dynamo, seconds at every start of a CPU run.
varlen_attn = None
if torch.cuda.is_available():
    with contextlib.suppress(ImportError):
        from torch.nn.attention.varlen import varlen_attn
    if varlen_attn is not None and "window_size" not in inspect.signature(varlen_attn).parameters:
        varlen_attn = None

BACKENDS = ("flash", "varlen", "cudnn", "sdpa")
LAYER_TYPES = ("global", "local")
# "auto", per layer type: the first of these that runs here, fastest first as bench.py measured them on an H200
# (forward + backward at 4 x 8192): in packed global layers cuDNN, 6.7 ms bidirectional and 3.9 causal against
# varlen_attn's 11.2 and 6.1; elsewhere (cuDNN has no window, nor bounds for documents kept apart) varlen_attn.
AUTO = {"global": ("cudnn", "flash", "varlen", "sdpa"), "local": ("flash", "varlen", "sdpa")}
KERNEL_DEVICE = "cuda"  # where the fused kernels run; they take float16 / bfloat16 q, k, v only
SDPA_KERNELS = {"cudnn": [SDPBackend.CUDNN_ATTENTION], "sdpa": None}  # the kernels SDPA may choose from (None: any)
CUDNN = torch.backends.cudnn.is_available() and torch.version.hip is None  # NVIDIA's cuDNN (ROCm's "cudnn" is MIOpen)


def compiler(setting, device):
    """`compile` (train.py's, eval.py's) -> the torch.compile backend, or None (eager); a ValueError if it names none.
    "auto": eager on CPU (inductor builds C++ for minutes); "aot_eager" traces as inductor does, with no code."""
    named = {"auto": "inductor" if device.type == "cuda" else None, "true": "inductor", "false": None}
    if setting.lower() in named:
        return named[setting.lower()]
    from torch._dynamo import list_backends  # seconds to import: only for a backend's name
    if setting not in list_backends(exclude_tags=()):
        raise ValueError(f"compile={setting!r}: choose auto, True, False or a torch.compile backend, e.g. inductor or "
                         "aot_eager (all: torch._dynamo.list_backends(exclude_tags=()))")
    return setting


def compile_model(model, backend="inductor", regional=False):
    """torch.compile(model), as train.py, eval.py and bench.py run it. Non-strict: inductor's fusion of LayerNorm
    backward's reductions (torch 2.10+) otherwise guards on the sizes it fuses, the MLM head's row count among them (a
    new mask rate would recompile the model). regional: each block (and the MLM head with its chunked loss) compiled
    in place, the rest eager: a graph per kind of block, a shorter warm-up. AOTAutograd's cache (read on resume) takes
    the chunked loss's autograd.Function only when allowed: traced into the graph that keys the cache, it is safe
    (pytorch#194007: DDP's graph and SDPA restricted to a kernel still miss it)."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor
    if hasattr(inductor.triton, "mix_order_reduction_non_strict_mode"):
        inductor.triton.mix_order_reduction_non_strict_mode = True
    if hasattr(functorch, "autograd_cache_allow_custom_autograd_functions"):  # torch 2.7+
        functorch.autograd_cache_allow_custom_autograd_functions = True
    if regional:
        for block in model.model.layers:
            block.compile(backend=backend)
        if hasattr(model, "cross_entropy_sum"):  # the MLM model's; a classifier's head runs eager
            model.cross_entropy_sum = torch.compile(model.cross_entropy_sum, backend=backend)
    else:
        model = torch.compile(model, backend=backend)
    model.register_forward_pre_hook(dynamic_rows, with_kwargs=True)  # run eagerly, before the compiled forward
    return model


def dynamic_rows(module, args, kwargs):
    """The rows with a target, and their targets: one dynamic size, so MLM's count, new every step, reuses one graph."""
    for name in ("rows", "targets"):
        if kwargs.get(name) is not None:
            torch._dynamo.mark_dynamic(kwargs[name], 0)


class Choice(dict):
    """The backend of each layer type, {"global": name, "local": name}: printed as one name where they agree."""

    def __str__(self):
        return self["global"] if self["global"] == self["local"] else ", ".join(f"{t} {b}" for t, b in self.items())


@dataclass(frozen=True)
class Kernels:
    """What choose() decided for one device and dtype: the Choice for packed batches (every sequence max_seqlen long)
    and for the others; where a forced backend cannot attend one of the two, the reason instead."""
    packed: Choice | str
    unpacked: Choice | str

    def of(self, packed):
        """The Choice for a batch that is `packed` or not; a RuntimeError saying why where there is none."""
        choice = self.packed if packed else self.unpacked
        if isinstance(choice, str):
            raise RuntimeError(choice)
        return choice


def choose(requested, device, dtype, dropout_p):
    """-> the Kernels on `device` for `dtype` q, k, v and dropout `dropout_p`, as MODERNBERT_ATTN or else `requested`
    names them: one for all layers ("varlen") or per layer type ("global=cudnn,local=varlen"); "auto": AUTO's first."""
    name = os.environ.get("MODERNBERT_ATTN") or requested
    parts = [part.partition("=") for part in name.split(",")]
    asked = {t: b for t, _, b in parts} if "=" in name else dict.fromkeys(LAYER_TYPES, name)
    if sorted(asked) != sorted(LAYER_TYPES) or not set(asked.values()) <= {"auto", *BACKENDS}:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}, or one per "
                         "layer type, as global=cudnn,local=varlen")
    forms = []
    for packed in (True, False):
        choice = Choice()
        for layer_type in LAYER_TYPES:
            options = AUTO[layer_type] if asked[layer_type] == "auto" else (asked[layer_type],)
            why = [refusal(b, layer_type, device, dtype, dropout_p, packed) for b in options]
            if None not in why:  # a forced backend ("auto" always ends in SDPA)
                choice = why[0]
                break
            choice[layer_type] = options[why.index(None)]
        forms.append(choice)
    return Kernels(*forms)


def refusal(name, layer_type, device, dtype, dropout_p, packed):
    """Why backend `name` cannot attend a layer of `layer_type` here; None where it can."""
    here = device.type == KERNEL_DEVICE
    if name == "flash" and (flash_attn_varlen_func is None or not here):
        return "attention backend 'flash' needs CUDA and `pip install flash-attn --no-build-isolation`"
    if name == "varlen" and (varlen_attn is None or not here):
        return "attention backend 'varlen' needs CUDA and a PyTorch whose varlen_attn has window_size (2.10+)"
    if name == "cudnn" and not (here and CUDNN):
        return "attention backend 'cudnn' (SDPA's cuDNN kernel) needs CUDA and a PyTorch built with NVIDIA's cuDNN"
    if name == "cudnn" and (layer_type == "local" or not packed):
        return ("attention backend 'cudnn' (SDPA's cuDNN kernel) attends the global layers of packed batches only (no "
                "window, no document bounds): give it those alone (global=cudnn,local=varlen) or use 'auto'")
    if name in ("flash", "varlen", "cudnn") and dtype not in (torch.float16, torch.bfloat16):
        return (f"attention backend {name!r} takes float16 or bfloat16 q, k, v, but this forward runs in {dtype}: run "
                "it under bf16 autocast (--dtype=bfloat16) or use attn_backend 'auto' or 'sdpa'")
    if name == "varlen" and dropout_p > 0:
        return ("attention backend 'varlen' has no attention-probability dropout; set attention_dropout=0 (use "
                "attn_out_dropout) or pick another backend")
    return None


class SDPAView:
    """SDPA over the sequences of an unpadded batch, for the layer types whose backend is "sdpa" or "cudnn". Sequences
    of one length (packed windows) are one (B, nh, S, hd) batch, only reshaped. Sequences of different lengths attend
    each alone on CPU (sum(L^2) rather than B * S^2); on a GPU, or under torch.compile (where a loop over the lengths
    would recompile for every batch), on a (B, S) view zero-padded by a scatter, with a padding mask."""

    def __init__(self, packing):
        cu_seqlens, positions = packing.cu_seqlens, packing.positions
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


# The LM loss in chunks of rows, never holding the (rows, vocab) logits (at 32k CLM rows and V = 50368: 6.6 GB in
# float32, which autograd would keep and then double with their gradient). The loss is the last op of the step, so its
# gradient with respect to a chunk's logits, softmax - onehot, is known as soon as the chunk's forward is: forward
# computes each chunk's gradients right away and drops its logits, and backward only scales them by the incoming scalar
# (Liger-Kernel's fused linear cross-entropy, in torch ops: nothing is recomputed). 2048 rows per chunk: 394 MiB of
# float32 logits at V = 50368, and a (2048 x 768) @ (768 x V) matmul still keeps the tensor cores busy.
CHUNK_ROWS = 2048


def chunked_cross_entropy(x, weight, bias, targets, chunk_rows=CHUNK_ROWS, max_rows=None):
    """x: (N, H) inputs of the decoder, targets: (N,) -> the float32 sum of the N cross-entropies of F.linear(x,
    weight, bias), as cross_entropy(logits.float(), targets, reduction="sum") gives it. max_rows, a bound on N that
    does not change between steps (the batch's token count), fixes the number of chunks: compiled, the loop has a fixed
    length and N stays symbolic, so an MLM step with another number of masked tokens reuses the graph."""
    n_chunks = max(1, -(-(max_rows or x.shape[0]) // chunk_rows))
    want_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(x, weight, bias, targets, n_chunks, want_grad)


class ChunkedCrossEntropy(torch.autograd.Function):
    """The rows, padded with ignored targets to n_chunks equal chunks; one chunk's logits and gradient at a time."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, n_chunks, want_grad):
        N = x.shape[0]
        chunk = -(-N // n_chunks)
        pad = n_chunks * chunk - N
        x, targets = F.pad(x, (0, 0, 0, pad)), F.pad(targets, (0, pad), value=-100)  # (n_chunks * chunk, ...)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        if want_grad:  # accumulated in float32 whatever the matmul dtype, cast to the inputs' dtype in backward
            grad_x, grad_w, grad_b = [torch.zeros_like(t, dtype=torch.float32) for t in (x, weight, bias)]
        for i in range(n_chunks):
            xc, yc = x[i * chunk:(i + 1) * chunk], targets[i * chunk:(i + 1) * chunk]  # (c, H), (c,)
            valid = yc >= 0  # (c,) False on the padding rows
            yc = yc.clamp_min(0)
            logits = F.linear(xc, weight, bias)  # (c, V), in autocast's dtype under autocast
            mm_dtype = logits.dtype
            logits = logits.float()  # the softmax in float32, as F.cross_entropy(logits.float()) would
            lse = logits.logsumexp(dim=-1)  # (c,)
            # Out of place: the tensor forward returns must not be one it updated in place, or torch 2.11's
            # dynamo hands backward a zero gradient for it (pytorch#180642): every gradient zero, compiled.
            loss = loss + ((lse - logits.gather(1, yc[:, None]).squeeze(1)) * valid).sum()
            if want_grad:
                grad = logits.sub_(lse[:, None]).exp_()  # (c, V) softmax, written over the logits
                grad.scatter_add_(1, yc[:, None], -valid[:, None].float())  # - onehot
                grad.mul_(valid[:, None])  # padding rows: no gradient
                grad = grad.to(mm_dtype)  # cast once for the three matmuls (which autocast runs in mm_dtype)
                # The bias gradient, a column sum, as a matrix product (rounded as the other two are): compiled, the
                # chunks' column sums fused into one slow kernel after the last chunk that kept every chunk's
                # gradient alive (H200, CLM at 4 x 8192: 8.8 ms of a 122 ms step).
                grad_b += valid.to(mm_dtype) @ grad  # (c,) @ (c, V)
                grad_x[i * chunk:(i + 1) * chunk] = grad @ weight  # (c, V) @ (V, H)
                grad_w += grad.T @ xc  # (V, c) @ (c, H)
        if want_grad:
            ctx.save_for_backward(grad_x[:N], grad_w, grad_b)
            ctx.dtypes = x.dtype, weight.dtype, bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        """d(grad_loss * loss) / d(x, weight, bias): the forward's gradients scaled by the upstream scalar."""
        return (*((g * grad_loss).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes)), None, None, None)
