"""support/kernels.py on CPU: the kernel each layer type gets ("auto" per layer type, forced, and the refusals), held
by the model as placed, and SDPA's cuDNN kernel on the packed (B, nh, S, hd) view, no mask (SDPA's CPU flash kernel
standing in), against SDPA. tests/test_gpu.py runs the kernels themselves on a GPU, with their backward.
"""

import pytest
import torch
import torch.nn.functional as F

import cpu_kernels
from model import cu_seqlens_of
from support import kernels
from test_gpu_path import randomized, run_model
from test_model import small_config

CPU, BF16 = torch.device("cpu"), torch.bfloat16
BOTH = lambda name: {"global": name, "local": name}  # noqa: E731


def pick(requested="auto", dtype=BF16, dropout_p=0.0, packed=True):
    return kernels.choose(requested, CPU, dtype, dropout_p).of(packed)


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
        pick("varlen", dropout_p=0.1)
    for bad in ("xformers", "flex", "global=cudnn", "global=cudnn,local=fast", "global=sdpa,local=sdpa,middle=sdpa"):
        with pytest.raises(ValueError, match="unknown attention backend.*global=cudnn,local=varlen"):
            pick(bad)
    monkeypatch.setattr(kernels, "KERNEL_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="'cudnn' .* needs CUDA"):
        pick("global=cudnn,local=sdpa")


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


def test_the_model_reads_the_kernels_chosen_where_it_was_placed(monkeypatch):
    """Chosen once per device and dtype, where the model is placed (MODERNBERT_ATTN read there, not per call); each
    forward reads the choice for its batch's form: cuDNN in the global layers of packed batches, varlen_attn in the
    others. A forward in another dtype than the one placed for chooses anew, once."""
    cpu_kernels.install(monkeypatch, backends=("varlen",))
    chosen, choose = [], kernels.choose
    monkeypatch.setattr(kernels, "choose", lambda *args: chosen.append(args[2]) or choose(*args))
    model = randomized(small_config("long_seqs")).place(CPU, BF16)  # global, local, local, global
    assert chosen == [BF16]
    monkeypatch.setenv("MODERNBERT_ATTN", "sdpa")  # after the choice: changes nothing
    for lengths in ([24, 24, 24], [1, 5, 37, 20], [24, 24, 24]):  # packed, documents kept apart, packed
        cpu_kernels.calls["varlen"].clear()
        ids = torch.randint(3, 256, (sum(lengths),))
        with torch.autocast("cpu", dtype=BF16), torch.no_grad():
            model(ids, cu_seqlens=cu_seqlens_of(lengths), max_seqlen=max(lengths))
        packed = len(set(lengths)) == 1
        assert len(cpu_kernels.calls["varlen"]) == (2 if packed else 4), lengths
    assert chosen == [BF16]
    with torch.no_grad():
        model(torch.randint(3, 256, (2, 9)))  # float32: the kernels take 16-bit q, k, v only
    assert chosen == [BF16, torch.float32] and model.model.kernels.of(packed=True) == BOTH("sdpa")
