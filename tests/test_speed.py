"""The parts of model.py that are there for speed and memory, against plain references: the chunked
LM loss against full logits + F.cross_entropy, RoPE in the activation dtype against the float32
rotation, and the FLOPs count against a brute-force count over explicit masks."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import model as model_py
from model import ModernBertConfig, ModernBertForMaskedLM, apply_rope, rope_cos_sin
from support.flops import PEAK_FLOPS, attention_pairs, peak_flops, training_flops
from test_model import SPECIAL, padded_batch, randomize_, small_config


def flat_batch(vocab, lengths, objective, seed=0):
    """Flat tokens, cu_seqlens, and the rows with a target and their targets: CLM = every position
    but the last of each sequence (next token); MLM = a random 30% of positions."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    tokens = torch.randint(3, vocab, (T,), generator=g)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    if objective == "clm":
        last = torch.zeros(T, dtype=torch.bool)
        last[cu[1:].long() - 1] = True
        rows = (~last).nonzero().squeeze(1)
        targets = tokens[rows + 1]
    else:
        rows = (torch.rand(T, generator=g) < 0.3).nonzero().squeeze(1)
        targets = torch.randint(0, vocab, (rows.numel(),), generator=g)
    return tokens, cu, max(lengths), rows, targets


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def plain_loss(model, tokens, cu, S, rows, targets, causal):
    """The reference: every logit of the rows materialised, then F.cross_entropy in float32."""
    hidden = model.model(tokens, cu, S, causal=causal)[rows]
    return F.cross_entropy(model.decoder(model.head(hidden)).float(), targets, reduction="sum")


# -----------------------------------------------------------------------------
# The chunked LM loss


@pytest.mark.parametrize("objective, bf16", [("mlm", False), ("clm", False), ("mlm", True)])
def test_chunked_loss_and_gradients_match_full_logits(objective, bf16):
    """Loss and every parameter's gradient (the tied embedding included) equal the plain path's within 1e-5 in
    float32, through forward(targets=...) and with chunk sizes that do not divide the rows, and under no_grad
    (evaluation). Under bf16 autocast the logits come from a bf16 matmul and the softmax runs in float32, as on the
    plain path: loss within 1e-3, float32 gradients within 2e-2."""
    model = randomize_(ModernBertForMaskedLM(small_config("odd_vocab"))).train()
    tokens, cu, S, rows, targets = flat_batch(1003, [70, 1, 33, 97], objective)
    causal = objective == "clm"
    loss_tol, grad_tol = (1e-3, 2e-2) if bf16 else (1e-5, 1e-5)
    assert rows.numel() % 7 and rows.numel() % 64  # the last chunk is a partial one
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref_loss, ref_grads = loss_and_grads(model, lambda: plain_loss(model, tokens, cu, S, rows, targets, causal))
        variants = {
            "forward": lambda: model(tokens, causal=causal, cu_seqlens=cu, max_seqlen=S, rows=rows, targets=targets),
            **{f"chunk {c}": lambda c=c: model.cross_entropy_sum(model.model(tokens, cu, S, causal=causal)[rows],
                                                                 targets, c) for c in (7, 64)}}
        results = {name: loss_and_grads(model, loss_fn) for name, loss_fn in variants.items()}
        with torch.no_grad():
            eval_loss = variants["forward"]()
    assert eval_loss.dtype == torch.float32 and abs(eval_loss - ref_loss) <= loss_tol * ref_loss
    for name, (loss, grads) in results.items():
        assert loss.dtype == torch.float32
        assert abs(loss - ref_loss) <= loss_tol * ref_loss, name
        for p, g in grads.items():
            assert g.dtype == torch.float32
            assert (g - ref_grads[p]).abs().max() <= grad_tol * ref_grads[p].abs().max(), f"{name}: {p}"


class Probe(TorchDispatchMode):
    """Records the most rows of any (rows, vocab) tensor an op produces, forward and backward, the dtypes of every
    tensor produced, and counts the matmuls."""

    def __init__(self, vocab=None):
        super().__init__()
        self.vocab, self.most_rows, self.matmuls, self.dtypes = vocab, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func.__name__ in ("mm.default", "addmm.default")
        for t in out if isinstance(out, (tuple, list)) else [out]:
            self.dtypes |= {t.dtype} if isinstance(t, torch.Tensor) else set()
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.vocab and not func.is_view:
                self.most_rows = max(self.most_rows, t.shape[0])  # a transposed weight is no new tensor
        return out


def test_chunked_loss_never_holds_more_than_a_chunk_of_logits():
    """A chunk of logits at most, forward and backward; under no_grad (evaluation) no gradient work: the head's dense
    and a matmul per chunk (with gradients: 4)."""
    model = randomize_(ModernBertForMaskedLM(small_config("odd_vocab"))).train()
    tokens, cu, S, rows, targets = flat_batch(1003, [40, 26], "clm")  # 64 rows: 4 chunks of 16
    for name, loss_fn, most in [
            ("plain", lambda: plain_loss(model, tokens, cu, S, rows, targets, True), rows.numel()),
            ("chunked", lambda: model.cross_entropy_sum(model.model(tokens, cu, S, causal=True)[rows], targets, 16), 16)]:
        with Probe(1003) as probe:
            loss_fn().backward()
        assert probe.most_rows == most, name  # the probe sees all rows on the plain path
    hidden = model.model(tokens, cu, S, causal=True)[rows].detach()
    for grad, matmuls in ((True, 1 + 4 * 4), (False, 1 + 4)):
        with torch.set_grad_enabled(grad), Probe(1003) as probe:
            model.cross_entropy_sum(hidden, targets, 16)
        assert probe.matmuls == matmuls, grad


def test_targets_need_the_unpadded_call():
    model = ModernBertForMaskedLM(small_config("odd_vocab"))
    ids, mask = padded_batch(1003, [5, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, mask, targets=ids[mask.bool()])


# -----------------------------------------------------------------------------
# RoPE in the activation dtype


def float32_rope_cos_sin(positions, head_dim, theta):
    """Textbook tables, float32, unsigned sin."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def float32_apply_rope(x, cos, sin):
    """The rotation in float32, cast back at the end (the path before this change, and transformers')."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return (xf * cos.view(shape) + torch.cat([-x2, x1], -1) * sin.view(shape)).to(x.dtype)


@pytest.mark.parametrize("name", ["long_seqs", "odd_vocab"])
def test_rope_in_bf16_matches_the_float32_rotation(name, monkeypatch):
    """Whole-model logits under bf16 autocast: RoPE applied in bf16 lands within bf16 tolerance of the
    float32 rotation, and is not further from the float32 model than that rotation is."""
    model = randomize_(ModernBertForMaskedLM(small_config(name))).eval()
    ids, mask = padded_batch(model.config.vocab_size, [300, 33, 5, 1, 64], seed=3)
    keep = mask.bool()
    with torch.no_grad():
        exact = model(ids, mask)[keep]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = model(ids, mask)[keep].float()
            # the textbook tables, not cast to bf16, into the float32 rotation
            positions, c = torch.arange(model.config.max_position_embeddings), model.config
            for kind, theta in (("global", c.global_rope_theta), ("local", c.local_rope_theta)):
                monkeypatch.setattr(model.model, f"rope_{kind}",
                                    torch.stack(float32_rope_cos_sin(positions, c.head_dim, theta)))
            monkeypatch.setattr(model.model, "compute_dtype", lambda device: torch.float32)
            monkeypatch.setattr(model_py, "apply_rope", float32_apply_rope)
            before = model(ids, mask)[keep].float()
    scale = exact.abs().max()
    print(f"{name}: |bf16 rope - f32 rope| max {(ours - before).abs().max() / scale:.2e} x max |logit|; "
          f"mean error vs float32 model {(ours - exact).abs().mean():.2e} (f32 rope {(before - exact).abs().mean():.2e})")
    assert (ours - before).abs().max() <= 0.02 * scale
    assert (ours - exact).abs().mean() <= 1.25 * (before - exact).abs().mean()


def test_rope_makes_no_float32_copy_of_q_and_k(monkeypatch):
    """Under autocast the forward hands apply_rope bf16 tables, and the rotation creates no float32 tensor."""
    model = ModernBertForMaskedLM(small_config("long_seqs")).eval()
    rotate, given = model_py.apply_rope, []
    monkeypatch.setattr(model_py, "apply_rope", lambda x, cos, sin: given.append((x.dtype, cos.dtype, sin.dtype,
                                                                                  cos.shape)) or rotate(x, cos, sin))
    ids, mask = padded_batch(model.config.vocab_size, [30, 7], seed=3)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids, mask)
    bf16 = torch.bfloat16
    assert given == [(bf16, bf16, bf16, (37, model.config.head_dim))] * model.config.num_hidden_layers
    positions = torch.arange(64)
    cos, sin = rope_cos_sin(positions, 16, 10000.0).to(torch.bfloat16)
    assert cos.shape == (64, 16)
    x = torch.randn(64, 2, 3, 16, dtype=torch.bfloat16)  # (T, q/k, nh, hd)
    with Probe() as probe:
        out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16 and probe.dtypes == {torch.bfloat16}
    x32, textbook = x.float(), float32_rope_cos_sin(positions, 16, 10000.0)  # and it is the rotation, in float32
    error = apply_rope(x32, *rope_cos_sin(positions, 16, 10000.0)) - float32_apply_rope(x32, *textbook)
    assert error.abs().max() <= 1e-6


# -----------------------------------------------------------------------------
# FLOPs and the GPU's peak


def brute_force_pairs(n, left, right):
    """Count the allowed (query, key) pairs of an explicit (n, n) mask."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        ok &= i - j <= left
    if right >= 0:
        ok &= j - i <= right
    return int(ok.sum())


def test_attention_pairs_match_a_brute_force_count():
    for n in [1, 2, 3, 5, 8, 9, 10, 17, 64, 65, 200]:
        for left, right in [(-1, -1), (-1, 0), (4, 4), (4, 0), (0, 0), (64, 64), (64, 0), (3, 7)]:
            assert attention_pairs(n, left, right) == brute_force_pairs(n, left, right), (n, left, right)


def test_peak_flops_by_exact_gpu_model(monkeypatch):
    """Each GPU by the name torch gives it; the lookup takes the first key found in the name, so a family listed
    before its variant ("H100" before "H100 PCIe") would shadow it: every entry of the table, as torch names such a
    GPU ("NVIDIA " + the key), gets its own figure, whatever is added to the table later."""
    cuda = torch.device("cuda")
    named = [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
             ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
             ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12)]
    assert len({key for key, _ in PEAK_FLOPS}) == len(PEAK_FLOPS)
    for name, flops in named + [(f"NVIDIA {key}", flops) for key, flops in PEAK_FLOPS]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert peak_flops(cuda) == flops, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Mystery GPU")
    with pytest.warns(UserWarning, match="peak_tflops"):
        assert peak_flops(cuda) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert peak_flops(cuda, peak_tflops=123.0) == 123e12  # the override wins, silently
        assert peak_flops(torch.device("cpu")) is None
        assert peak_flops(torch.device("cpu"), peak_tflops=2.0) == 2e12


# ---------------------------------------------------------------------------------------------------------------------
# training_flops against PyTorch's FlopCounterMode (the matmuls a real forward + backward dispatches, 2 FLOPs per
# multiply-add). training_flops counts only the (query, key) pairs the masks keep, a varlen kernel's work; SDPA on
# CPU (math backend, whose bmm the counter sees) computes all n^2 pairs of each sequence in every layer and masks
# afterwards, 12 x H FLOPs per pair over forward and backward. So, exactly:
#     FlopCounterMode = training_flops + 12 x H x (L x sum(n^2) - the pairs the masks keep)
# with the kept pairs counted from explicit masks, not with attention_pairs.


def kept_pairs(config, lengths, causal):
    """The pairs every layer's mask keeps, from (n, n) masks built here."""
    window = lambda layer: -1 if config.is_global(layer) else config.local_attention // 2  # noqa: E731
    return sum(brute_force_pairs(n, window(layer), 0 if causal else window(layer))
               for layer in range(config.num_hidden_layers) for n in lengths)


@pytest.mark.parametrize("causal", [True, False])
def test_training_flops_against_flop_counter(causal):
    config = ModernBertConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, local_attention=8, **SPECIAL)  # layers: global, local, local
    model = ModernBertForMaskedLM(config)
    lengths = [24, 17, 9, 3]  # sequences longer and shorter than the window (+-4)
    tokens, cu, S, rows, targets = flat_batch(config.vocab_size, lengths, "clm" if causal else "mlm")
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, causal=causal, cu_seqlens=cu, max_seqlen=S, rows=rows, targets=targets).backward()
    counted = counter.get_total_flops()
    ours = training_flops(config, lengths, causal, rows.numel())
    masked_out = config.num_hidden_layers * sum(n * n for n in lengths) - kept_pairs(config, lengths, causal)
    print(f"causal={causal}: training_flops / FlopCounterMode = {ours / counted:.6f} raw, "
          f"{(ours + 12 * config.hidden_size * masked_out) / counted:.6f} with the pairs SDPA masks out")
    assert ours + 12 * config.hidden_size * masked_out == counted
    assert training_flops(config, cu.diff(), causal, rows.numel()) == ours  # cu_seqlens.diff() works too


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
