"""
ModernBERT, written out by hand (Warner et al., 2024), for the CLM-detour recipe.

Read top to bottom: config -> attention (and its kernels) -> RoPE -> Block -> encoder ->
heads (MLM/CLM, classifiers) -> Hugging Face checkpoint read/write -> FLOPs for MFU.

The whole model runs on *unpadded* tokens: a flat (T,) tensor of token ids from
B sequences laid end to end, with `cu_seqlens` (int32, B+1) marking where each
sequence starts. No FLOP is spent on padding. The one switch `causal` turns the
bidirectional encoder into a causal language model: every layer gets a causal
mask and local layers see (64 left, 0 right) tokens instead of (64, 64).
Nothing else changes, which is what makes the CLM detour possible.
"""

import inspect
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


# -----------------------------------------------------------------------------
# Config: field names follow Hugging Face's ModernBERT config.json


@dataclass
class ModernBertConfig:
    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152  # width of one GeGLU branch; Wi maps H -> 2 * this
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    local_attention: int = 128  # local layers see +- local_attention // 2 tokens
    global_attn_every_n_layers: int = 3  # layer i is global iff i % n == 0
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    pad_token_id: int = 50283
    cls_token_id: int = 50281
    sep_token_id: int = 50282
    bos_token_id: int = 50281
    eos_token_id: int = 50282
    # Dropout. Hugging Face applies `attention_dropout` both to the attention
    # probabilities and after Wo; ModernBERT's pretraining used 0.1 after Wo only,
    # which `attn_out_dropout` expresses (None: same as attention_dropout).
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_out_dropout: float | None = None
    mlp_dropout: float = 0.0
    classifier_dropout: float = 0.0
    classifier_pooling: str = "mean"  # "mean" over tokens or "cls"
    id2label: dict | None = None  # classifiers: {"0": "label", ...} as in config.json
    problem_type: str | None = None  # "single_label_classification" or "multi_label_classification"
    # "auto" picks flash-attn, then torch varlen_attn (CUDA), then SDPA.
    # The environment variable MODERNBERT_ATTN overrides it.
    attn_backend: str = "auto"

    @property
    def num_labels(self):
        return len(self.id2label) if self.id2label else 2

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def is_global(self, layer):
        return layer % self.global_attn_every_n_layers == 0

    @classmethod
    def base(cls, **kw):
        return cls(**kw)  # the defaults are ModernBERT-base: 22 x 768 x 12, branch 1152

    @classmethod
    def large(cls, **kw):
        return cls(**{**dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28,
                             num_attention_heads=16), **kw})

    @classmethod
    def from_hf_dict(cls, d):
        """Read a Hugging Face config.json, old style or transformers-5 style."""
        if d.get("model_type", "modernbert") != "modernbert":
            raise ValueError(f"config.json has model_type={d['model_type']!r}; this code only reads ModernBERT "
                             "checkpoints (model_type 'modernbert')")
        for key, want in [("hidden_activation", "gelu"), ("norm_bias", False), ("attention_bias", False),
                          ("mlp_bias", False), ("decoder_bias", True), ("classifier_bias", False),
                          ("classifier_activation", "gelu")]:
            if key in d and d[key] != want:
                raise ValueError(f"config.json has {key}={d[key]!r}; ModernBERT as written here needs {want!r}")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        layer_types = d.get("layer_types")
        if layer_types:  # transformers 5: an explicit list; we need it to be periodic
            n = next((i for i, t in enumerate(layer_types[1:], 1) if t == "full_attention"), len(layer_types))
            expect = ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(layer_types))]
            if layer_types != expect:
                raise ValueError(f"config.json layer_types is not 'global every n layers': {layer_types}")
            kw["global_attn_every_n_layers"] = n
        rope = d.get("rope_parameters") or {}
        for hf_type, ours in [("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")]:
            params = rope.get(hf_type) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"config.json rope_parameters[{hf_type!r}] uses rope_type "
                                 f"{params['rope_type']!r}; only 'default' RoPE is supported")
            if "rope_theta" in params:
                kw[ours] = params["rope_theta"]
        # Some converted checkpoints carry local_rope_theta -1 (or null): "same as global".
        if kw.get("local_rope_theta") in (None, -1):
            kw["local_rope_theta"] = kw.get("global_rope_theta", cls.global_rope_theta)
        for k in ("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id"):
            if kw.get(k) is None:
                kw.pop(k, None)
        return cls(**kw)

    def to_hf_dict(self):
        """config.json that transformers 4.48+ and 5 both read (old keys and new keys)."""
        d = {k: v for k, v in asdict(self).items() if k != "attn_backend" and v is not None}
        if self.id2label:
            d["label2id"] = {label: int(i) for i, label in self.id2label.items()}
        n = self.num_hidden_layers
        d.update(
            architectures=["ModernBertForMaskedLM"], model_type="modernbert", hidden_activation="gelu",
            norm_bias=False, attention_bias=False, mlp_bias=False, decoder_bias=True, classifier_bias=False,
            classifier_activation="gelu", tie_word_embeddings=True, sparse_prediction=False,
            layer_types=["full_attention" if self.is_global(i) else "sliding_attention" for i in range(n)],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": self.global_rope_theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta}},
        )
        return d


# -----------------------------------------------------------------------------
# Attention over an unpadded batch. The layout: tokens of B sequences end to end, cu_seqlens
# marking where each starts; Packing holds what every layer's attention shares; attention()
# takes q, k, v of shape (T, nh, hd) and a layer type's window (left, right) in tokens
# (-1 = unlimited), and returns (T, nh, hd).


def cu_seqlens_of(lengths):
    """Sequence lengths (B,), a list or a tensor -> cu_seqlens (B+1,) int32: 0, then where each sequence ends."""
    return F.pad(torch.as_tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))


@dataclass
class Flat:
    """A batch as the model runs it: the tokens of B sequences laid end to end, and, for a batch that
    came padded, where each token was, to put per-token results back."""
    tokens: torch.Tensor  # (T,)
    cu_seqlens: torch.Tensor  # (B+1,) int32: 0, then where each sequence ends
    max_seqlen: int
    keep: torch.Tensor = None  # (T,) the row of each token in the flattened (B*S) padded batch
    shape: tuple = None  # (B, S) of the padded batch; None for a batch that came flat

    def restore(self, x):
        """Per-token rows (T, ...) -> (B, S, ...) for a batch that came padded (padded positions are zero)."""
        return x if self.shape is None else repad(x, self.keep, *self.shape)


def unpad(input_ids, attention_mask):
    """(B, S) padded batch -> Flat."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    keep = attention_mask.bool().flatten().nonzero().squeeze(1)  # (T,)
    lengths = attention_mask.bool().sum(dim=1, dtype=torch.int32)  # (B,)
    return Flat(input_ids.flatten()[keep], cu_seqlens_of(lengths), int(lengths.max()), keep, tuple(input_ids.shape))


def repad(x, keep, B, S):
    """Flat rows (T, ...) back to (B, S, ...); padded positions are zero."""
    out = x.new_zeros(B * S, *x.shape[1:]).index_copy(0, keep, x)
    return out.view(B, S, *x.shape[1:])


def as_flat(input_ids, attention_mask=None, cu_seqlens=None, max_seqlen=None):
    """Either input form as a Flat: padded (B, S) ids are unpadded, flat (T,) ids with cu_seqlens taken as they are."""
    return unpad(input_ids, attention_mask) if cu_seqlens is None else Flat(input_ids, cu_seqlens, max_seqlen)


class Packing:
    """Everything about the layout of an unpadded batch that every layer shares.

    Built once per forward: positions for RoPE (restarting at 0 in each sequence),
    and for the SDPA backend the scatter index into a re-padded (B, S) view and
    the boolean masks (only attention is re-padded; every other op stays flat).
    """

    def __init__(self, T, cu_seqlens, max_seqlen, causal, half_window, backend):
        self.cu_seqlens, self.max_seqlen, self.causal, self.backend = cu_seqlens, max_seqlen, causal, backend
        # The kernels take the keys' cu_seqlens apart from the queries'. One tensor passed as both would be a
        # duplicate input of flash-attn's autograd.Function, which torch.compile cannot trace: a graph break in
        # every layer. A copy, once per batch, costs B+1 ints.
        self.cu_seqlens_k = cu_seqlens.clone() if backend != "sdpa" else None
        lengths = cu_seqlens.diff()  # (B,)
        starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=T)  # (T,)
        self.positions = torch.arange(T, device=cu_seqlens.device) - starts  # (T,)
        self.windows = {"global": (-1, -1), "local": (half_window, half_window)}  # layer type -> (left, right)
        if causal:
            self.windows = {layer_type: (left, 0) for layer_type, (left, _) in self.windows.items()}
        if backend == "sdpa":
            B, S, dev = lengths.numel(), max_seqlen, cu_seqlens.device
            self.padded = T != B * S  # False for packed windows: then q, k, v are only viewed as (B, S)
            idx = torch.arange(S, device=dev)
            offset = idx[None, :] - idx[:, None]  # (S, S): key position - query position
            if self.padded:
                seq_id = torch.repeat_interleave(torch.arange(B, device=dev), lengths, output_size=T)
                self.pad_index = seq_id * S + self.positions  # (T,) row in the flattened (B*S) view
                valid = idx[None, :] < lengths[:, None]  # (B, S)
            self.masks = {}  # layer type -> (boolean mask or None, is_causal)
            for layer_type, (left, right) in self.windows.items():
                if left < 0 and not self.padded:  # full attention: no mask, so SDPA picks its fast kernels
                    self.masks[layer_type] = (None, right == 0)
                    continue
                ok = torch.ones(S, S, dtype=torch.bool, device=dev)
                if left >= 0:
                    ok &= offset >= -left
                if right >= 0:
                    ok &= offset <= right
                if self.padded:
                    # Keys must be real tokens. Padded query rows would see no key at all (softmax of
                    # nothing = NaN): let them see everything; their outputs are thrown away.
                    ok = (ok & valid[:, None, :]) | ~valid[:, :, None]  # (B, S, S)
                    ok = ok[:, None]  # (B, 1, S, S)
                self.masks[layer_type] = (ok, False)


def attention(q, k, v, packing, layer_type, dropout_p):
    """Scaled dot-product attention over the sequences of an unpadded batch, in a "global" or "local" layer."""
    left, right = packing.windows[layer_type]
    cu, cu_k, S = packing.cu_seqlens, packing.cu_seqlens_k, packing.max_seqlen
    if packing.backend == "flash":
        return flash_attn_varlen_func(q, k, v, cu, cu_k, S, S, dropout_p=dropout_p, causal=packing.causal,
                                      window_size=(left, right))
    if packing.backend == "varlen":
        return varlen_attn(q, k, v, cu, cu_k, S, S, window_size=(left, right))
    # SDPA on a (B, S) view: zero-padded by a scatter when the sequences differ in length.
    T, nh, hd = q.shape
    B = cu.numel() - 1

    def view(x):  # (T, nh, hd) -> (B, nh, S, hd)
        return (repad(x, packing.pad_index, B, S) if packing.padded else x.view(B, S, nh, hd)).transpose(1, 2)

    mask, is_causal = packing.masks[layer_type]
    out = F.scaled_dot_product_attention(view(q), view(k), view(v), attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=is_causal)
    out = out.transpose(1, 2).reshape(B * S, nh, hd)
    return out[packing.pad_index] if packing.padded else out  # (T, nh, hd)


# The kernels: flash-attn's varlen kernel, PyTorch's own varlen_attn, else SDPA (CPU, float32, fallback).

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
# PyTorch's own varlen_attn is looked up on the first forward on the kernel device, not here: its
# module imports torch._dynamo, seconds at every start of a CPU run that never uses it.
varlen_attn, varlen_looked_up = None, False


def find_varlen_attn():
    """torch.nn.attention.varlen.varlen_attn if this PyTorch has it with a sliding window (2.10+), else None."""
    global varlen_attn, varlen_looked_up
    if not varlen_looked_up:
        varlen_looked_up = True
        try:
            from torch.nn.attention.varlen import varlen_attn as fn
            # Early versions of varlen_attn have no sliding window; ModernBERT needs one.
            varlen_attn = fn if "window_size" in inspect.signature(fn).parameters else None
        except ImportError:
            varlen_attn = None
    return varlen_attn

BACKENDS = ("flash", "varlen", "sdpa")
# The fused kernels run on CUDA and take float16 / bfloat16 q, k, v only (both check it and raise);
# a float32 forward (no autocast) attends with SDPA. Tests point KERNEL_DEVICE at "cpu" to run
# the kernels' real wrappers there on an emulation of the kernels (tests/cpu_kernels.py).
KERNEL_DEVICE = "cuda"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def pick_backend(requested, device, dtype, dropout_p):
    """The backend a forward on `device` with q, k, v of `dtype` uses: MODERNBERT_ATTN, else the
    config, else ("auto") the fastest one that runs here."""
    name = os.environ.get("MODERNBERT_ATTN") or requested
    kernels = device.type == KERNEL_DEVICE and dtype in KERNEL_DTYPES
    if device.type == KERNEL_DEVICE:
        find_varlen_attn()
    if name == "auto":
        if kernels and flash_attn_varlen_func is not None:
            return "flash"
        if kernels and varlen_attn is not None and dropout_p == 0.0:
            return "varlen"
        return "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if name == "flash" and (flash_attn_varlen_func is None or device.type != KERNEL_DEVICE):
        raise RuntimeError("attention backend 'flash' needs CUDA and `pip install flash-attn --no-build-isolation`")
    if name == "varlen" and (varlen_attn is None or device.type != KERNEL_DEVICE):
        raise RuntimeError("attention backend 'varlen' needs CUDA and a PyTorch whose "
                           "torch.nn.attention.varlen.varlen_attn has window_size (2.10+)")
    if name != "sdpa" and dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"attention backend {name!r} takes float16 or bfloat16 q, k, v, but this forward runs in "
                           f"{dtype}: run it under bf16 autocast (--dtype=bfloat16) or use attn_backend 'auto' or 'sdpa'")
    if name == "varlen" and dropout_p > 0:
        raise RuntimeError("attention backend 'varlen' has no attention-probability dropout; "
                           "set attention_dropout=0 (use attn_out_dropout) or pick another backend")
    return name


# -----------------------------------------------------------------------------
# Rotary position embedding (rotate-half / NeoX style, on the full head dim)


def compute_dtype(device_type, default):
    """The dtype of matmul outputs (q, k, v) on this device type now: autocast's when it is on, else `default`."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def rope_cos_sin(positions, head_dim, theta):
    """cos and signed sin tables, (T, head_dim), for apply_rope: built once per forward.

    The angles are computed in float32 (bf16 positions would be off by whole tokens), then the tables
    are cast once to the dtype q and k have (autocast's, else float32): so the rotation, in every
    layer, runs in that dtype instead of making float32 copies of q and k and casting back.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    dtype = compute_dtype(positions.device.type, torch.float32)
    # rotate_half(x) = cat(-x2, x1) = roll(x, hd/2) * [-1 .. -1, 1 .. 1]: that sign goes into sin.
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)  # (T, hd) each


def apply_rope(x, cos, sin):
    """x: (T, ..., hd) -> x * cos + rotate_half(x) * sin, in x's dtype: pairs (i, i + hd/2) rotated
    by the position's angle. Three kernels (roll, mul, addcmul) and no float32 copy of x."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)  # broadcast over the middle dims
    cos, sin = cos.to(x.dtype).view(shape), sin.to(x.dtype).view(shape)  # no-ops unless x is not autocast's dtype
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


# -----------------------------------------------------------------------------
# The transformer


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.nh, self.hd = config.num_attention_heads, config.head_dim
        self.layer_type = "global" if config.is_global(layer) else "local"
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.dropout_p = config.attention_dropout
        out_p = config.attention_dropout if config.attn_out_dropout is None else config.attn_out_dropout
        self.out_drop = nn.Dropout(out_p)

    def forward(self, x, packing, rope):
        T = x.shape[0]
        qkv = self.Wqkv(x).view(T, 3, self.nh, self.hd)  # rows laid out [Q heads | K heads | V heads]
        qk = apply_rope(qkv[:, :2], *rope[self.layer_type])  # q and k rotated in one go, (T, 2, nh, hd)
        (q, k), v = qk.unbind(dim=1), qkv[:, 2]  # each (T, nh, hd)
        y = attention(q, k, v, packing, self.layer_type, self.dropout_p if self.training else 0.0)
        return self.out_drop(self.Wo(y.reshape(T, self.nh * self.hd)))


class MLP(nn.Module):
    """GeGLU: Wo(gelu(a) * g) where a, g = Wi(x).chunk(2)."""

    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        a, g = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(a) * g))


class Block(nn.Module):
    """Pre-norm: x += Attn(LN(x)); x += MLP(LN(x)). Layer 0 has no attention norm
    because the embedding LayerNorm just ran."""

    def __init__(self, config, layer):
        super().__init__()
        norm = lambda: nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)  # noqa: E731
        self.attn_norm = norm() if layer > 0 else nn.Identity()
        self.attn = Attention(config, layer)
        self.mlp_norm = norm()
        self.mlp = MLP(config)

    def forward(self, x, packing, rope):
        x = x + self.attn(self.attn_norm(x), packing, rope)
        return x + self.mlp(self.mlp_norm(x))


class Embeddings(nn.Module):
    """LayerNorm(token embedding): ModernBERT has no position embedding (RoPE does that)."""

    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, tokens):
        return self.drop(self.norm(self.tok_embeddings(tokens)))


class ModernBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def attention_backend(self, device):
        """The attention backend of a forward on `device` now: it depends on the dtype that reaches
        the kernel (autocast's, else the weights'), and on dropout in training mode."""
        dtype = compute_dtype(device.type, self.embeddings.tok_embeddings.weight.dtype)
        c = self.config
        return pick_backend(c.attn_backend, device, dtype, c.attention_dropout if self.training else 0.0)

    def forward(self, tokens, cu_seqlens, max_seqlen, causal=False, return_layers=False):
        """tokens (T,) -> hidden states (T, H) after the final norm.

        With return_layers=True also returns the list of the L layer outputs, each
        (T, H), before the final norm (what cka.py compares).
        """
        c = self.config
        backend = self.attention_backend(tokens.device)
        packing = Packing(tokens.shape[0], cu_seqlens, max_seqlen, causal, c.local_attention // 2, backend)
        rope = {"global": rope_cos_sin(packing.positions, c.head_dim, c.global_rope_theta),
                "local": rope_cos_sin(packing.positions, c.head_dim, c.local_rope_theta)}
        x = self.embeddings(tokens)
        layers = []
        for block in self.layers:
            x = block(x, packing, rope)
            layers.append(x)
        x = self.final_norm(x)
        return (x, layers) if return_layers else x


# -----------------------------------------------------------------------------
# Heads. The MLM head serves both objectives; the classifiers share its dense -> GELU -> LayerNorm.


class PredictionHead(nn.Module):
    """dense -> GELU -> LayerNorm; shared by the MLM/CLM head and the classifiers."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


# The LM loss in chunks of rows. The (rows, V) logits are the largest tensors of a training step:
# at 32k CLM rows and V = 50368 they take 6.6 GB in float32, and plain autograd keeps them (as
# log-softmax) for backward and then materialises their gradient too. But the loss is the last op
# of the step, so its gradient with respect to a chunk's logits, softmax - onehot, is known as soon
# as the chunk's forward is: forward computes each chunk's gradients right away and drops its
# logits, and backward only scales the stored gradients by the incoming scalar. That is
# Liger-Kernel's fused linear cross-entropy, written with torch ops; unlike checkpointing each
# chunk it recomputes nothing.
#
# 2048 rows per chunk: at V = 50368 a chunk's float32 logits take 394 MiB (0.6 GiB with their bf16
# copy beside them under autocast), against 13+ GB unchunked at 32k rows; and a (2048 x 768) @
# (768 x V) matmul is still big enough to keep the tensor cores busy. A CLM micro batch of 4 x 8192
# tokens is 16 chunks: the loop costs nothing next to the matmuls.
LOSS_CHUNK_ROWS = 2048


class ChunkedCrossEntropy(torch.autograd.Function):
    """sum_i cross_entropy(x_i @ weight.T + bias, targets_i) in float32, x: (N, H), targets: (N,), in
    n_chunks chunks of ceil(N / n_chunks) rows, holding one chunk's (rows, V) logits and their
    gradient at a time.

    The number of chunks is fixed by the caller from a bound on N that does not change between steps
    (the batch's token count), and N varies only the chunk size: under torch.compile the loop has a
    fixed length and N stays symbolic, so an MLM step with another number of masked tokens reuses the
    compiled graph instead of compiling one per row count. The rows are padded to n_chunks x chunk
    with ignored targets (-100) to make every chunk the same size."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, n_chunks, want_grad):
        N = x.shape[0]
        chunk = -(-N // n_chunks)
        pad = n_chunks * chunk - N
        x, targets = F.pad(x, (0, 0, 0, pad)), F.pad(targets, (0, pad), value=-100)  # (n_chunks * chunk, ...)
        loss = torch.zeros((), device=x.device, dtype=torch.float32)
        if want_grad:  # accumulated in float32 whatever the matmul dtype, cast to the inputs' dtype in backward
            grad_x = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32)
        for i in range(n_chunks):
            xc, yc = x[i * chunk:(i + 1) * chunk], targets[i * chunk:(i + 1) * chunk]  # (c, H), (c,)
            valid = yc >= 0  # (c,) False on the padding rows
            yc = yc.clamp_min(0)
            logits = F.linear(xc, weight, bias)  # (c, V), in autocast's dtype under autocast
            mm_dtype = logits.dtype
            logits = logits.float()  # the softmax in float32, as F.cross_entropy(logits.float()) would
            lse = logits.logsumexp(dim=-1)  # (c,)
            loss += ((lse - logits.gather(1, yc[:, None]).squeeze(1)) * valid).sum()
            if want_grad:
                grad = logits.sub_(lse[:, None]).exp_()  # (c, V) softmax, written over the logits
                grad.scatter_add_(1, yc[:, None], -valid[:, None].float())  # - onehot
                grad.mul_(valid[:, None])  # padding rows: no gradient
                grad_b += grad.sum(dim=0)
                grad = grad.to(mm_dtype)  # cast once for both matmuls (which autocast runs in mm_dtype)
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


class PreTrained(nn.Module):
    """What the three task models share: ModernBERT's init, the encoder call, Hugging Face checkpoint
    read/write."""

    def _init_weights(self, module):
        """ModernBERT's init: truncated normal cut at 2 std; 0.02 in, 0.02/sqrt(2L) for the output
        projections; the classifier at hidden_size**-0.5 (as transformers)."""
        c = self.config
        std_in, std_out = c.initializer_range, c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)

        def trunc(w, std):
            cut = c.initializer_cutoff_factor * std
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-cut, b=cut)

        if isinstance(module, Embeddings):
            trunc(module.tok_embeddings.weight, std_in)
        elif isinstance(module, Attention):
            trunc(module.Wqkv.weight, std_in)
            trunc(module.Wo.weight, std_out)
        elif isinstance(module, MLP):
            trunc(module.Wi.weight, std_in)
            trunc(module.Wo.weight, std_out)
        elif isinstance(module, PredictionHead):
            trunc(module.dense.weight, std_out)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
        elif module is getattr(self, "classifier", None):
            trunc(module.weight, c.hidden_size ** -0.5)
            nn.init.zeros_(module.bias)
        elif module is getattr(self, "decoder", None):
            nn.init.zeros_(module.bias)

    def encode(self, flat, causal=False):
        """Flat -> final hidden states (T, H): the encoder, called once whatever form the input came in."""
        return self.model(flat.tokens, flat.cu_seqlens, flat.max_seqlen, causal=causal)

    def num_params(self):
        """Parameter count with the tied decoder weight counted once (as transformers reports)."""
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay):
        """AdamW groups of the trainable parameters: weight_decay on the matrices, none on biases and norm
        weights (the 1-D parameters)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    # Hugging Face checkpoints: the functions at the end of this file.

    def save_pretrained(self, path):
        save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path, **overrides):
        return from_pretrained(cls, path, **overrides)


class ModernBertForMaskedLM(PreTrained):
    """Encoder + LM head (dense, GELU, LayerNorm, decoder tied to the embeddings).

    The same head serves MLM and CLM: only which rows are predicted, and whether
    the mask is causal, differ between the two objectives.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)
        self.head = PredictionHead(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.apply(self._init_weights)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied: one tensor

    def logits(self, hidden):
        """(N, H) -> (N, V). Apply to selected rows only for sparse prediction."""
        return self.decoder(self.head(hidden))

    def cross_entropy_sum(self, hidden, targets, chunk_rows=LOSS_CHUNK_ROWS, max_rows=None):
        """(N, H) final hidden states of the predicted rows and their (N,) targets -> the float32 sum
        of the N cross-entropies, as cross_entropy(self.logits(hidden).float(), targets, reduction="sum")
        but with the decoder and the softmax in chunks of at most chunk_rows rows (ChunkedCrossEntropy).
        max_rows, a bound on N that does not change between steps (the batch's token count), fixes
        the number of chunks. The dense, GELU, LayerNorm part of the head runs on all rows at once: its
        activations are only (N, H). Gradients are computed only where autograd will ask for them:
        not under torch.no_grad (evaluation)."""
        n_chunks = max(1, -(-(max_rows or hidden.shape[0]) // chunk_rows))
        want_grad = torch.is_grad_enabled() and (hidden.requires_grad or self.decoder.weight.requires_grad)
        return ChunkedCrossEntropy.apply(self.head(hidden), self.decoder.weight, self.decoder.bias, targets,
                                         n_chunks, want_grad)

    def forward(self, input_ids, attention_mask=None, causal=False, *, cu_seqlens=None, max_seqlen=None, rows=None,
                targets=None):
        """By input form:

        - padded (B, S) ids (and attention_mask) -> (B, S, V) logits; rows at padded positions are zero;
        - flat (T,) ids with cu_seqlens and max_seqlen, and `rows` (N,), the positions that have a
          target -> their (N, V) logits (sparse prediction: the head runs on those rows only; all T
          rows if rows is None);
        - the same with `targets` (N,) -> the float32 sum of their cross-entropies (cross_entropy_sum),
          which is how training gets its loss: through forward, so that DDP's hooks see the call.
        """
        flat = as_flat(input_ids, attention_mask, cu_seqlens, max_seqlen)
        hidden = self.encode(flat, causal)
        hidden = hidden if rows is None else hidden[rows]
        if targets is not None:
            if flat.shape is not None:
                raise ValueError("targets need the unpadded call: flat ids with cu_seqlens, max_seqlen and the "
                                 "rows that have a target (see data.py's Batch)")
            return self.cross_entropy_sum(hidden, targets, max_rows=input_ids.shape[0])  # T: fixed between steps
        return flat.restore(self.logits(hidden))


def mean_pool(hidden, cu_seqlens):
    """Flat hidden states (T, H) -> (B, H): the mean over each sequence's tokens (no padding to mask out)."""
    lengths = cu_seqlens.diff()  # (B,)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths,
                                  output_size=hidden.shape[0])  # (T,) the sequence of each token
    sums = hidden.new_zeros(lengths.numel(), hidden.shape[1]).index_add_(0, seq, hidden)  # (B, H)
    return sums / lengths[:, None].to(hidden.dtype)


class Classifier(PreTrained):
    """Encoder -> PredictionHead -> dropout -> linear (config.num_labels), laid out as transformers'."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = ModernBertModel(config)
        self.head = PredictionHead(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.apply(self._init_weights)


class ModernBertForSequenceClassification(Classifier):
    """Pool (mean over tokens, or [CLS]), then the classifier."""

    def forward(self, input_ids, attention_mask=None, *, cu_seqlens=None, max_seqlen=None):
        """(B, S) padded or flat (T,) with cu_seqlens -> (B, num_labels) logits."""
        flat = as_flat(input_ids, attention_mask, cu_seqlens, max_seqlen)
        hidden = self.encode(flat)
        if self.config.classifier_pooling == "cls":
            pooled = hidden[flat.cu_seqlens[:-1].long()]
        else:
            pooled = mean_pool(hidden, flat.cu_seqlens)
        return self.classifier(self.drop(self.head(pooled)))


class ModernBertForTokenClassification(Classifier):
    """The classifier on every token."""

    def forward(self, input_ids, attention_mask=None, *, cu_seqlens=None, max_seqlen=None):
        """(B, S) padded -> (B, S, num_labels); flat (T,) with cu_seqlens -> (T, num_labels)."""
        flat = as_flat(input_ids, attention_mask, cu_seqlens, max_seqlen)
        return flat.restore(self.classifier(self.drop(self.head(self.encode(flat)))))


# -----------------------------------------------------------------------------
# Hugging Face checkpoints: config.json + model.safetensors (or pytorch_model.bin)


def save_pretrained(model, path):
    """Write config.json and model.safetensors that transformers loads as they are."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**model.config.to_hf_dict(), "architectures": [type(model).__name__]}, f, indent=2)
    # decoder.weight is the embedding matrix: stored once, as transformers does.
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "decoder.weight"}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def from_pretrained(cls, path, **overrides):
    """Load a Hugging Face ModernBERT directory (ModernBertForMaskedLM, ModernBertModel or a
    fine-tuned classifier). The encoder must be there; a task head that is not (a classifier
    on top of an MLM checkpoint) starts from its init, as in transformers.

    `overrides` set config fields the file does not decide (attn_backend, dropout, labels).
    """
    model = cls(load_config(path, **overrides))
    state = load_state(path)
    if not any(k.startswith("model.") for k in state):  # a bare ModernBertModel checkpoint
        state = {"model." + k: v for k, v in state.items()}
    expected = {k: v for k, v in model.state_dict().items() if k != "decoder.weight"}
    optional = ("classifier.", "head.") if cls is not ModernBertForMaskedLM else ()
    missing = sorted(k for k in set(expected) - set(state) if not k.startswith(optional))
    other_heads = ("decoder.", "classifier.", "head.", "drop.")  # heads of other task models
    unexpected = sorted(k for k in set(state) - set(expected) if not k.startswith(other_heads))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match a {cls.__name__} of its config.json: "
                         f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for k in sorted(set(expected) & set(state)):
        if state[k].shape != expected[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)} but config.json implies "
                             f"{tuple(expected[k].shape)}")
    model.load_state_dict({k: state[k] for k in set(expected) & set(state)}, strict=False)
    return model


def load_config(path, **overrides):
    """ModernBertConfig from a checkpoint directory's config.json."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; a Hugging Face ModernBERT checkpoint directory has "
                                "config.json and model.safetensors")
    with open(cfg_path) as f:
        return ModernBertConfig(**{**asdict(ModernBertConfig.from_hf_dict(json.load(f))), **overrides})


def load_state(path):
    """The state dict of a checkpoint directory: model.safetensors, else pytorch_model.bin."""
    st, pt = os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin")


# -----------------------------------------------------------------------------
# FLOPs, for MFU

# Dense bf16 tensor-core peak by GPU, as torch.cuda.get_device_name names it ("NVIDIA H100 80GB HBM3"
# is the SXM board, "NVIDIA H100 PCIe", "NVIDIA H100 NVL"). Datasheet figures without sparsity. The first
# key found in the name wins, so a variant comes before its family. Anything else: set peak_tflops.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12), ("H200", 989e12),
              ("A100", 312e12), ("L40S", 362e12), ("RTX 4090", 165e12)]  # "H200" also matches "GH200": 989


def attention_pairs(n, left, right):
    """The (query, key) pairs attention computes on one sequence of n tokens when each query sees up
    to `left` keys before it and `right` after it (-1: unlimited), clipped at the sequence's ends:
    the n pairs (i, i), plus on each side, for every distance d = 1 .. m with m = min(window, n - 1),
    the n - d queries that have a key at distance d: m * n - m * (m + 1) / 2."""

    def side(window):
        m = n - 1 if window < 0 else min(window, n - 1)
        return m * n - m * (m + 1) // 2

    return n + side(left) + side(right)


def training_flops(config, seqlens, causal, n_rows):
    """FLOPs of forward + backward on one batch: sequences of lengths `seqlens` (ints, e.g.
    cu_seqlens.diff().tolist()), with the LM head on n_rows of their tokens.

        6 x block matmul weights x tokens  +  6 x (head dense + decoder) x n_rows
        + 12 x H x (query, key) pairs, over all layers and sequences

    6 = 2 FLOPs per multiply-add x 3 (forward, and backward to inputs and to weights). A pair costs
    2 x 2 x H forward (QK^T and AV over all heads), x 3 with backward, and only the pairs the mask
    keeps count: each sequence's real length (not seq_len), the local window clipped at both ends,
    and under the causal mask only keys at or before the query (attention_pairs): the work of the
    varlen kernels. SDPA with a dense mask computes every pair of its padded (B, S, S) view and
    masks afterwards; tests/test_flops.py checks that torch's FlopCounterMode on that path counts
    exactly this plus 12 x H per pair masked out."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    seqlens = [int(n) for n in seqlens]
    per_layer = 4 * H * H + 3 * H * config.intermediate_size  # Wqkv + Wo + Wi (2 branches) + Wo
    n_global = sum(config.is_global(i) for i in range(L))
    half = config.local_attention // 2
    pairs = sum(n_global * attention_pairs(n, -1, 0 if causal else -1)
                + (L - n_global) * attention_pairs(n, half, 0 if causal else half) for n in seqlens)
    return 6 * L * per_layer * sum(seqlens) + 6 * (H * H + H * V) * n_rows + 12 * H * pairs


def peak_flops(device, peak_tflops=0.0):
    """The device's dense bf16 peak in FLOP/s: `peak_tflops` x 1e12 when it is set (> 0), else looked up
    by the GPU's name. None means no MFU: on CPU, or on a GPU not in PEAK_FLOPS (with a warning that
    says which config key to set)."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((flops for key, flops in PEAK_FLOPS if key in name), None)
    if peak is None:
        warnings.warn(f"no peak FLOP/s known for the GPU {name!r}, so no MFU is reported; set peak_tflops to its "
                      "dense bf16 tensor-core TFLOP/s (datasheet figure without sparsity), e.g. --peak_tflops=989")
    return peak
