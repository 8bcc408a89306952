"""
ModernBERT, written out by hand (Warner et al., 2024), for the CLM-detour recipe.

The whole model runs on *unpadded* tokens: a flat (T,) tensor of token ids from B sequences laid end to end, with
`cu_seqlens` (int32, B+1) marking where each sequence starts. No FLOP is spent on padding. The one switch `causal`
turns the bidirectional encoder into a causal language model: every layer gets a causal mask and local layers see
(64 left, 0 right) tokens instead of (64, 64). Nothing else changes, which is what makes the CLM detour possible.
Behind it: the attention kernels and the chunked LM loss (support/kernels.py), Hugging Face files (support/hf.py).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from support import hf, kernels


# -----------------------------------------------------------------------------
# Config: field names follow Hugging Face's ModernBERT config.json; the defaults are ModernBERT-base.


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
    # Dropout. Hugging Face applies `attention_dropout` both to the attention probabilities and after Wo;
    # ModernBERT's pretraining used 0.1 after Wo only, which `attn_out_dropout` says (None: attention_dropout).
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_out_dropout: float | None = None
    mlp_dropout: float = 0.0
    classifier_dropout: float = 0.0
    classifier_pooling: str = "mean"  # "mean" over tokens or "cls"
    id2label: dict | None = None  # classifiers: {"0": "label", ...} as in config.json
    problem_type: str | None = None  # "single_label_classification" or "multi_label_classification"
    attn_backend: str = "auto"  # "auto", one backend or one per layer type (support/kernels.py); MODERNBERT_ATTN wins

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def is_global(self, layer):
        return layer % self.global_attn_every_n_layers == 0

    def check_positions(self, length, what, fix, whose=""):
        """`what` ("{}" where the number goes) of `length` tokens is within RoPE's tables, else a ValueError. The
        message is made only then: compiled with dynamic shapes, formatting a symbolic length would break the graph."""
        if length > self.max_position_embeddings:
            raise ValueError(f"{what.format(length)} is beyond {whose}max_position_embeddings="
                             f"{self.max_position_embeddings}: {fix}")

    @classmethod
    def large(cls, **kw):
        return cls(**{**dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=28,
                             num_attention_heads=16), **kw})


# -----------------------------------------------------------------------------
# The unpadded layout: the tokens of B sequences end to end, cu_seqlens marking where each starts.


def cu_seqlens_of(lengths):
    """Sequence lengths (B,), a list or a tensor -> cu_seqlens (B+1,) int32: 0, then where each sequence ends."""
    return F.pad(torch.as_tensor(lengths).cumsum(0, dtype=torch.int32), (1, 0))


@dataclass
class Flat:
    """A batch as the model runs it: the tokens of B sequences laid end to end. For a batch that came padded,
    `keep` and `shape` say where each token was, to put per-token results back."""
    tokens: torch.Tensor  # (T,)
    cu_seqlens: torch.Tensor  # (B+1,) int32: 0, then where each sequence ends
    max_seqlen: int
    keep: torch.Tensor = None  # (T,) the row of each token in the flattened (B*S) padded batch
    shape: tuple = None  # (B, S) of the padded batch; None for a batch that came flat

    @classmethod
    def of(cls, input_ids, attention_mask=None, cu_seqlens=None, max_seqlen=None):
        """Either input form: padded (B, S) ids are unpadded, flat (T,) ids with cu_seqlens taken as they are."""
        if cu_seqlens is not None:
            return cls(input_ids, cu_seqlens, max_seqlen)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        keep = mask.flatten().nonzero().squeeze(1)  # (T,)
        lengths = mask.sum(dim=1, dtype=torch.int32)  # (B,)
        return cls(input_ids.flatten()[keep], cu_seqlens_of(lengths), int(lengths.max()), keep, tuple(input_ids.shape))

    def restore(self, x):
        """Per-token rows (T, ...) -> (B, S, ...) for a batch that came padded (padded positions are zero)."""
        if self.shape is None:
            return x
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:]).index_copy(0, self.keep, x)
        return out.view(*self.shape, *x.shape[1:])


class Packing:
    """What every layer's attention shares about an unpadded batch, built once per forward: the sequences
    (cu_seqlens, max_seqlen), RoPE positions restarting at 0 in each sequence, and each layer type's window."""

    def __init__(self, T, cu_seqlens, max_seqlen, causal, half_window, backend):
        self.cu_seqlens, self.max_seqlen, self.causal, self.backend = cu_seqlens, max_seqlen, causal, backend
        starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff(), output_size=T)  # (T,)
        self.positions = torch.arange(T, device=cu_seqlens.device) - starts  # (T,)
        # The switch of the detour. A window is (left, right) in tokens, -1 = unlimited: global layers see their
        # whole sequence, local layers half_window tokens on each side; under the causal mask, no key after the query.
        right = lambda window: 0 if causal else window  # noqa: E731
        self.windows = {"global": (-1, right(-1)), "local": (half_window, right(half_window))}
        # The keys' own cu_seqlens: one tensor as both would break the compiled graph at flash-attn's autograd.Function.
        self.cu_seqlens_k = cu_seqlens.clone() if {"flash", "varlen"} & set(backend.values()) else None
        self.sdpa = kernels.SDPAView(self) if {"sdpa", "cudnn"} & set(backend.values()) else None


def attention(q, k, v, packing, layer_type, dropout_p):
    """Scaled dot-product attention over the sequences of an unpadded batch in a "global" or "local" layer:
    q, k, v (T, nh, hd) -> (T, nh, hd). The kernels: support/kernels.py."""
    window, cu, cu_k, S = packing.windows[layer_type], packing.cu_seqlens, packing.cu_seqlens_k, packing.max_seqlen
    backend = packing.backend[layer_type]
    if backend == "flash":
        return kernels.flash_attn_varlen_func(q, k, v, cu, cu_k, S, S, dropout_p=dropout_p, causal=packing.causal,
                                              window_size=window)
    if backend == "varlen":
        return kernels.varlen_attn(q, k, v, cu, cu_k, S, S, window_size=window)
    return packing.sdpa(q, k, v, layer_type, dropout_p)  # SDPA or its cuDNN kernel, per sequence or on a (B, S) view


# -----------------------------------------------------------------------------
# Rotary position embedding (rotate-half / NeoX style, on the full head dim)


def rope_cos_sin(positions, head_dim, theta):
    """cos and signed sin, (2, P, head_dim) float32, for apply_rope at `positions`: the angles in float32 (bf16
    positions would be off by whole tokens)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # (P, hd/2)
    cos, sin = angles.cos(), angles.sin()
    # rotate_half(x) = cat(-x2, x1) = roll(x, hd/2) * [-1 .. -1, 1 .. 1]: that sign goes into sin.
    return torch.stack([torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)])  # (2, P, hd)


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
        self.dropout_p, out_p = config.attention_dropout, config.attn_out_dropout
        self.out_drop = nn.Dropout(config.attention_dropout if out_p is None else out_p)

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
    """Pre-norm: x += Attn(LN(x)); x += MLP(LN(x)). Layer 0 has no attention norm: the embedding LayerNorm just ran."""

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
        # RoPE's tables for every position, built once (built in the forward, compiled code recomputes them per element)
        positions = torch.arange(config.max_position_embeddings)
        for kind, theta in (("global", config.global_rope_theta), ("local", config.local_rope_theta)):
            self.register_buffer(f"rope_{kind}", rope_cos_sin(positions, config.head_dim, theta), persistent=False)
        self.kernels, self.kernels_for = None, None  # the attention kernels, and the (device type, dtype) they are for

    def compute_dtype(self, device):
        """The dtype of matmul outputs (q, k, v) on `device` now: autocast's when it is on, else the weights'."""
        on = torch.is_autocast_enabled(device.type)
        return torch.get_autocast_dtype(device.type) if on else self.embeddings.tok_embeddings.weight.dtype

    def choose_kernels(self, device, dtype):
        """Each layer type's attention kernel on `device` for q, k, v of `dtype`, held for the forward to read."""
        self.kernels = kernels.choose(self.config.attn_backend, device, dtype, self.config.attention_dropout)
        self.kernels_for = (device.type, dtype)

    def forward(self, tokens, cu_seqlens, max_seqlen, causal=False, return_layers=False):
        """tokens (T,) -> hidden states (T, H) after the final norm; with return_layers, also the L layer outputs,
        each (T, H), before the final norm (what cka.py compares)."""
        c = self.config
        c.check_positions(max_seqlen, "a sequence of {} tokens", "cut sequences to that length")
        dtype = self.compute_dtype(tokens.device)
        if self.kernels_for != (tokens.device.type, dtype):  # a model no script placed there (PreTrained.place)
            self.choose_kernels(tokens.device, dtype)
        packed = tokens.shape[0] == max_seqlen * (len(cu_seqlens) - 1)  # every sequence max_seqlen long
        packing = Packing(tokens.shape[0], cu_seqlens, max_seqlen, causal, c.local_attention // 2,
                          self.kernels.of(packed))
        # The rows of this batch's positions, cast once to q and k's dtype: no float32 copy of q and k in any layer.
        rope = {kind: tuple(getattr(self, f"rope_{kind}")[:, packing.positions].to(dtype))  # cos, sin: (T, hd) each
                for kind in ("global", "local")}
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
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=False)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


class PreTrained(nn.Module):
    """What the three task models share: the encoder and its head, ModernBERT's init, Hugging Face checkpoints."""

    def __init__(self, config):
        super().__init__()
        self.config, self.model, self.head = config, ModernBertModel(config), PredictionHead(config)

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
        elif isinstance(module, (Attention, MLP)):  # in: Wqkv or Wi; out: Wo
            trunc((module.Wqkv if isinstance(module, Attention) else module.Wi).weight, std_in)
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

    def encode(self, flat, causal=False):  # Flat -> final hidden states (T, H), whatever form the input came in
        return self.model(flat.tokens, flat.cu_seqlens, flat.max_seqlen, causal=causal)

    def place(self, device, dtype=torch.float32):
        """The model on `device`, its attention kernels chosen once for q, k, v of `dtype` (autocast's). -> self"""
        self.model.choose_kernels(torch.device(device), dtype)
        return self.to(device)

    def num_params(self):  # the tied decoder weight once, as transformers counts
        return sum(p.numel() for p in self.parameters())

    def param_groups(self, weight_decay):
        """AdamW groups of the trainable parameters: weight_decay on the matrices, none on biases and norms (1-D)."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    save_pretrained = hf.save  # (self, path): config.json and model.safetensors, as transformers loads them

    @classmethod
    def from_pretrained(cls, path, **overrides):
        """A Hugging Face ModernBERT directory (ModernBertForMaskedLM, ModernBertModel or a fine-tuned classifier).
        `overrides` set config fields the file does not decide (attn_backend, dropout, labels)."""
        model = cls(hf.load_config(ModernBertConfig, path, **overrides))
        hf.load_weights(model, path)
        return model


class ModernBertForMaskedLM(PreTrained):
    """Encoder + LM head (dense, GELU, LayerNorm, decoder tied to the embeddings), the same for MLM and CLM."""

    def __init__(self, config):
        super().__init__(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=True)
        self.apply(self._init_weights)
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied: one tensor

    def forward(self, input_ids, attention_mask=None, causal=False, *, cu_seqlens=None, max_seqlen=None, rows=None,
                targets=None):
        """Padded (B, S) ids (and attention_mask) -> (B, S, V) logits, zero at padded positions. Flat (T,) ids with
        cu_seqlens and max_seqlen, and `rows` (N,), the positions that have a target -> their (N, V) logits (the head
        runs on those rows only; all T if rows is None); with `targets` (N,) too -> the float32 sum of their
        cross-entropies: training's loss, through forward, so that DDP's hooks see the call."""
        flat = Flat.of(input_ids, attention_mask, cu_seqlens, max_seqlen)
        hidden = self.encode(flat, causal)
        hidden = hidden if rows is None else hidden[rows]
        if targets is None:
            return flat.restore(self.decoder(self.head(hidden)))
        if flat.shape is not None:
            raise ValueError("targets need the unpadded call: flat ids, cu_seqlens, max_seqlen, rows (data.py's Batch)")
        return self.cross_entropy_sum(hidden, targets, max_rows=input_ids.shape[0])  # T: fixed between steps

    def cross_entropy_sum(self, hidden, targets, chunk_rows=kernels.CHUNK_ROWS, max_rows=None):
        """(N, H) final hidden states of the predicted rows, (N,) targets -> the float32 sum of their cross-entropies,
        the decoder and the softmax in chunks of rows (support/kernels.py): the (N, V) logits are never held."""
        return kernels.chunked_cross_entropy(self.head(hidden), self.decoder.weight, self.decoder.bias, targets,
                                             chunk_rows, max_rows)


def mean_pool(hidden, cu_seqlens):
    """Flat hidden states (T, H) -> (B, H): the mean over each sequence's tokens (no padding to mask out)."""
    lengths = cu_seqlens.diff()  # (B,)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths,
                                  output_size=hidden.shape[0])  # (T,) the sequence of each token
    sums = hidden.new_zeros(lengths.numel(), hidden.shape[1]).index_add_(0, seq, hidden)  # (B, H)
    return sums / lengths[:, None].to(hidden.dtype)


class Classifier(PreTrained):
    """Encoder -> PredictionHead -> dropout -> linear (a logit per label of id2label, else 2), as transformers'."""

    def __init__(self, config):
        super().__init__(config)
        self.drop = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.hidden_size, len(config.id2label) if config.id2label else 2)
        self.apply(self._init_weights)


class ModernBertForSequenceClassification(Classifier):
    def forward(self, input_ids, attention_mask=None, *, cu_seqlens=None, max_seqlen=None):
        """(B, S) padded or flat (T,) with cu_seqlens -> (B, num_labels) logits of the pooled tokens (mean or [CLS])."""
        flat = Flat.of(input_ids, attention_mask, cu_seqlens, max_seqlen)
        hidden = self.encode(flat)
        cls = self.config.classifier_pooling == "cls"
        pooled = hidden[flat.cu_seqlens[:-1].long()] if cls else mean_pool(hidden, flat.cu_seqlens)
        return self.classifier(self.drop(self.head(pooled)))


class ModernBertForTokenClassification(Classifier):
    def forward(self, input_ids, attention_mask=None, *, cu_seqlens=None, max_seqlen=None):
        """(B, S) padded -> (B, S, num_labels); flat (T,) with cu_seqlens -> (T, num_labels)."""
        flat = Flat.of(input_ids, attention_mask, cu_seqlens, max_seqlen)
        return flat.restore(self.classifier(self.drop(self.head(self.encode(flat)))))
