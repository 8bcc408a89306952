"""
The FLOPs of a training step and the GPU's peak, for MFU (train.py's log, bench.py), and the usual 6N + 12LHQT count.

A step costs 6 x block matmul weights x tokens + 6 x (head dense + decoder) x predicted rows + attention: 6 = 2
FLOPs per multiply-add x 3 (forward, and backward to inputs and to weights); the decoder's bias gradient, a matrix
product in support/kernels.py, adds 2 x vocab per predicted row. A (query, key) pair costs 2 x 2 x H forward (QK^T
and AV over all heads), x 3 with backward, and only the pairs the mask keeps count: each sequence's real length (not
seq_len), the local window clipped at both ends, and under the causal mask only keys at or before the query: the work
of the varlen kernels (SDPA with a dense mask computes every pair of its padded (B, S, S) view).
"""

import warnings

import torch

# Dense bf16 tensor-core peak by GPU, as torch.cuda.get_device_name names it ("NVIDIA H100 80GB HBM3" is the SXM
# board), datasheet figures without sparsity. The first key found in the name wins: a variant before its family.
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12), ("H200", 989e12),
              ("A100", 312e12), ("L40S", 362e12), ("RTX 4090", 165e12)]  # "H200" also matches "GH200": 989


def attention_pairs(n, left, right):
    """The (query, key) pairs attention computes on one sequence of n tokens when each query sees up to `left`
    keys before it and `right` after it (-1: unlimited), clipped at the sequence's ends."""

    def side(window):  # for each distance d = 1 .. m, the n - d queries that have a key at distance d
        m = n - 1 if window < 0 else min(window, n - 1)
        return m * n - m * (m + 1) // 2

    return n + side(left) + side(right)  # the n pairs (i, i), then each side


def training_flops(config, seqlens, causal, n_rows):
    """FLOPs of forward + backward on sequences of lengths `seqlens` (ints), with the LM head on n_rows tokens."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    seqlens = [int(n) for n in seqlens]
    per_layer = 4 * H * H + 3 * H * config.intermediate_size  # Wqkv + Wo + Wi (2 branches) + Wo
    n_global = sum(config.is_global(i) for i in range(L))
    half = config.local_attention // 2
    pairs = sum(n_global * attention_pairs(n, -1, 0 if causal else -1)
                + (L - n_global) * attention_pairs(n, half, 0 if causal else half) for n in seqlens)
    return 6 * L * per_layer * sum(seqlens) + (6 * H * H + 6 * H * V + 2 * V) * n_rows + 12 * H * pairs


def batch_flops(config, batches, causal):
    """The training FLOPs of data.Batch micro batches, from their real sequence lengths and target rows."""
    seqlens = [n for b in batches for n in b.cu_seqlens.diff().tolist()]
    return training_flops(config, seqlens, causal, sum(b.targets.numel() for b in batches))


def convention_flops(config, n_params, tokens, seq_len):
    """The usual count, which other codebases' MFU figures use (PaLM's appendix B, nanoGPT): 6N + 12 x L x H x Q x T
    FLOPs per token, N the parameters (the tied embedding once). It counts the head on every token and every layer as
    global and bidirectional, so it reads higher than training_flops: about twice as high for Base's MLM at 4 x 8192."""
    L, H, Q = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    return tokens * (6 * n_params + 12 * L * H * Q * seq_len)


def peak_flops(device, peak_tflops=0.0):
    """The device's dense bf16 peak in FLOP/s: `peak_tflops` x 1e12 when it is set (> 0), else looked up by the
    GPU's name. None means no MFU: on CPU, or on a GPU not in PEAK_FLOPS (with a warning naming the key to set)."""
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
