"""support/kernels.py on CPU: the kernel each layer type gets ("auto" per layer type, forced, and the refusals), and
the two views the newer backends attend through, against independent references:

- FlexAttention's block mask (forward only on CPU) against float64 attention with the window written out
  (test_gpu_path.reference), on blocks small enough that blocks skipped, partial and full all occur; the blocks it
  visits counted by hand;
- SDPA's cuDNN kernel on the packed (B, nh, S, hd) view, no mask (SDPA's CPU flash kernel standing in), against SDPA.

tests/test_gpu.py runs both kernels themselves on a GPU, with their backward.
"""

import pytest
import torch
import torch.nn.functional as F

import cpu_kernels
from model import Packing, attention, cu_seqlens_of
from support import kernels
from test_gpu_path import randomized, reference, run_model
from test_model import small_config

# On CPU FlexAttention runs its eager path (a GPU compiles it), exact and quick at these sizes: no warning for that.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
CPU, BF16 = torch.device("cpu"), torch.bfloat16
BOTH = lambda name: {"global": name, "local": name}  # noqa: E731


def pick(requested="auto", dtype=BF16, dropout_p=0.0, packed=True):
    return kernels.pick_backend(requested, CPU, dtype, dropout_p, packed)


def test_auto_picks_the_fastest_kernel_per_layer_type_and_falls_back(monkeypatch):
    cpu_kernels.install(monkeypatch, backends=("varlen",))  # a GPU without flash-attn, as the H200 runs were
    assert pick() == {"global": "cudnn", "local": "varlen"}  # packed: cuDNN where there is no window
    assert pick(packed=False) == BOTH("varlen")  # documents kept apart: cuDNN would need a mask
    assert pick(dtype=torch.float32) == BOTH("sdpa")  # the kernels take bf16 / fp16 only
    assert pick(dropout_p=0.1) == {"global": "cudnn", "local": "sdpa"}  # varlen_attn has no attention dropout
    cpu_kernels.install(monkeypatch, backends=("flash", "varlen"))
    assert pick() == {"global": "cudnn", "local": "flash"} and pick(packed=False) == BOTH("flash")
    monkeypatch.setattr(kernels, "CUDNN", False)  # a ROCm build, or one without cuDNN
    assert pick() == BOTH("flash")
    monkeypatch.setattr(kernels, "KERNEL_DEVICE", "cuda")  # a CPU, as it is
    assert pick() == BOTH("sdpa") and pick(packed=False) == BOTH("sdpa")


def test_forced_backends_and_their_refusals(monkeypatch):
    cpu_kernels.install(monkeypatch, backends=("varlen",))
    assert pick("varlen") == BOTH("varlen") and str(pick("varlen")) == "varlen"
    both = pick("global=cudnn,local=varlen")
    assert both == {"global": "cudnn", "local": "varlen"} and str(both) == "global cudnn, local varlen"
    monkeypatch.setenv("MODERNBERT_ATTN", "sdpa")
    assert pick("varlen") == BOTH("sdpa")
    monkeypatch.delenv("MODERNBERT_ATTN")
    with pytest.raises(RuntimeError, match=r"global layers of packed batches only.*global=cudnn,local=varlen"):
        pick("cudnn")  # the local layers have a window
    with pytest.raises(RuntimeError, match="global layers of packed batches only"):
        pick("global=cudnn,local=varlen", packed=False)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        pick("global=cudnn,local=sdpa", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="no attention-probability dropout"):
        pick("flex", dropout_p=0.1)
    with pytest.raises(RuntimeError, match="'flex' has no backward on CPU"):
        pick("flex")
    with torch.no_grad():
        assert pick("flex", dtype=torch.float32) == BOTH("flex")
    for bad in ("xformers", "global=cudnn", "global=cudnn,local=fast", "global=sdpa,local=sdpa,middle=sdpa"):
        with pytest.raises(ValueError, match="unknown attention backend.*global=cudnn,local=varlen"):
            pick(bad)
    monkeypatch.setattr(kernels, "KERNEL_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="'cudnn' .* needs CUDA"):
        pick("global=cudnn,local=sdpa")


def flex_packing(lengths, causal, half_window):
    return Packing(sum(lengths), cu_seqlens_of(lengths), max(lengths), causal, half_window,
                   kernels.Choice(BOTH("flex")))


@pytest.mark.parametrize("lengths", [[24, 24, 24], [1, 6, 30, 13, 9]])  # packed windows; documents kept apart
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layer_type", ["global", "local"])
def test_flex_block_mask_against_float64(monkeypatch, lengths, causal, layer_type):
    """Blocks of 8 tokens against windows of +-4 and documents of 1 to 30 tokens, the batch not a whole number of
    blocks (59 tokens): blocks skipped everywhere, and in the global layers of documents blocks seen whole (no mask)
    beside blocks masked."""
    monkeypatch.setattr(kernels, "FLEX_BLOCK", 8)
    packing = flex_packing(lengths, causal, 4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        out = attention(q, k, v, packing, layer_type, 0.0)
    left, right = packing.windows[layer_type]
    ref, _ = reference(q, k, v, lengths, left, right, 16 ** -0.5)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    mask = packing.flex.masks[layer_type]
    partial, full = mask.kv_num_blocks.sum().item(), mask.full_kv_num_blocks.sum().item()
    assert partial + full < (-(-sum(lengths) // 8)) ** 2  # some blocks skipped
    if len(lengths) == 5 and layer_type == "global":
        assert partial > 0 and full > 0


def test_flex_visits_only_the_blocks_a_window_reaches(monkeypatch):
    """Packed windows of 64 tokens in blocks of 8, a local window of +-4: a query block's keys reach at most one
    block on each side within its sequence, so 8 x 3 - 2 = 22 block pairs per sequence (the first and the last
    block have one neighbour), none of them full (a block's first and last queries see different keys); the global
    layer sees its 8 x 8 blocks whole."""
    monkeypatch.setattr(kernels, "FLEX_BLOCK", 8)
    packing = flex_packing([64, 64], False, 4)
    local, glob = packing.flex.masks["local"], packing.flex.masks["global"]
    assert local.kv_num_blocks.sum().item() == 2 * 22 and local.full_kv_num_blocks.sum().item() == 0
    assert glob.kv_num_blocks.sum().item() == 0 and glob.full_kv_num_blocks.sum().item() == 2 * 64


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_the_model_through_flex_matches_sdpa(padded, causal):
    """Forward only (FlexAttention has no CPU backward), float32, whole model: logits as SDPA's."""
    model = randomized(small_config("long_seqs", num_hidden_layers=3)).eval()
    lengths = [1, 5, 37, 20] if padded else [24, 24, 24]
    with torch.no_grad():
        out, ref = (run_model(model, backend, causal, padded, lengths, dtype=torch.float32)[0]
                    for backend in ("flex", "sdpa"))
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_layers_attend_the_packed_view_with_no_mask(monkeypatch, causal):
    """"auto" with neither flash-attn nor varlen_attn, SDPA's CPU flash kernel standing in for cuDNN's: the global
    layers call SDPA on the (B, nh, S, hd) view, with no mask, restricted to that kernel (the math kernel off); the
    local layers SDPA with their window's mask, any kernel. bf16 autocast, forward and backward, against SDPA in
    float32. A batch of documents kept apart falls back to SDPA in every layer."""
    cpu_kernels.install(monkeypatch, backends=())
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):  # (shape, no mask, causal, the math kernel allowed)
        calls.append((tuple(q.shape), attn_mask is None, kw["is_causal"], torch.backends.cuda.math_sdp_enabled()))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = randomized(small_config("long_seqs")).train()  # global, local, local, global
    out, grads = run_model(model, "auto", causal, False, [24, 24, 24])
    cudnn = ((3, 4, 24, 16), True, causal, False)
    assert [c == cudnn for c in calls] == [True, False, False, True]
    assert all(c[3] and not c[1] for c in calls[1:3])
    ref, ref_grads = run_model(model, "sdpa", causal, False, [24, 24, 24], dtype=torch.float32)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 0.03 * g.norm() + 1e-6, name
    calls.clear()
    run_model(model, "auto", causal, True, [1, 5, 37, 20])
    assert calls and all(c[3] for c in calls)
