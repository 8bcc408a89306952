"""The FLOP count behind MFU (support/flops.training_flops) against PyTorch's own counter, FlopCounterMode, which
counts the matmuls a real forward + backward dispatches (mm, addmm, bmm: 2 FLOPs per multiply-add).

The accounting that differs, on purpose: training_flops counts only the (query, key) pairs the mask keeps
(each sequence's real length, the local window clipped at the sequence's ends, the causal half), the work
a varlen kernel does. SDPA on CPU attends each sequence alone, with a dense boolean mask in the local layers:
it computes all n^2 pairs of a sequence of n tokens in every layer and masks afterwards, 12 x H FLOPs per pair
over forward and backward (QK^T and PV, 2 x 2 x H each, and twice that for their gradients). So, exactly:

    FlopCounterMode = training_flops + 12 x H x (L x sum(n^2) - the pairs the masks keep)

with the kept pairs counted here from explicit masks, not with model.attention_pairs. SDPA runs on its math
backend, whose bmm the counter sees (no FLOP formula is registered for the fused CPU kernel).
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import ModernBertConfig, ModernBertForMaskedLM
from support.flops import training_flops

SPECIAL = dict(pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)


def kept_pairs(config, lengths, causal):
    """The pairs every layer's mask keeps, from (n, n) masks built here."""
    total = 0
    for layer in range(config.num_hidden_layers):
        for n in lengths:
            q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
            ok = k <= q if causal else torch.ones(n, n, dtype=torch.bool)
            if not config.is_global(layer):
                ok = ok & ((q - k).abs() <= config.local_attention // 2)
            total += int(ok.sum())
    return total


@pytest.mark.parametrize("causal", [True, False])
def test_training_flops_against_flop_counter(causal):
    config = ModernBertConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, local_attention=8, **SPECIAL)  # layers: global, local, local
    model = ModernBertForMaskedLM(config)
    lengths = [24, 17, 9, 3]  # sequences longer and shorter than the window (+-4)
    T, S = sum(lengths), max(lengths)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.vocab_size, (T,), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if causal:  # CLM: every token but the last of its sequence predicts the next
        rows = torch.tensor([i for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()) for i in range(s, e - 1)])
    else:  # MLM: the head on a sparse subset of rows
        rows = torch.randperm(T, generator=g)[:11].sort().values
    targets = torch.randint(3, config.vocab_size, (rows.numel(),), generator=g)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, causal=causal, cu_seqlens=cu, max_seqlen=S, rows=rows, targets=targets).backward()
    counted = counter.get_total_flops()
    ours = training_flops(config, lengths, causal, rows.numel())
    masked_out = config.num_hidden_layers * sum(n * n for n in lengths) - kept_pairs(config, lengths, causal)
    print(f"causal={causal}: training_flops / FlopCounterMode = {ours / counted:.6f} raw, "
          f"{(ours + 12 * config.hidden_size * masked_out) / counted:.6f} with the pairs SDPA masks out")
    assert ours + 12 * config.hidden_size * masked_out == counted


def test_the_usual_convention_by_hand():
    """6N + 12 x L x H x Q x T per token. ModernBERT-base: N = 149,655,232 (transformers' count: embeddings
    50368 x 768 = 38,682,624; 22 layers of Wqkv 1,769,472 + Wo 589,824 + Wi 1,769,472 + Wo 884,736 and two norms of
    768, the first layer one; the final norm, the head's dense 589,824 and norm, the decoder's bias 50,368). At
    T = 8192: 6N = 897,931,392 and 12 x 22 x 12 x 64 x 8192 = 1,660,944,384 per token. The H200's packed MLM step,
    204.8k tokens/s, is then 53.0% of 989 TFLOP/s, as issue 57 quotes."""
    from support.flops import convention_flops

    base = ModernBertConfig()
    assert convention_flops(base, 149_655_232, 1, 8192) == 897_931_392 + 1_660_944_384
    assert round(100 * convention_flops(base, 149_655_232, 204_800, 8192) / 989e12, 1) == 53.0
    tiny = ModernBertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=2)  # Q = 4
    assert convention_flops(tiny, 1000, 32, 16) == 32 * (6 * 1000 + 12 * 2 * 2 * 4 * 16)
