"""The GPU path, run on CPU: what a GPU user runs, through the kernels' real wrappers (flash-attn 2.8.3's
flash_attn_varlen_func, torch's varlen_attn) on a CPU emulation of the compiled kernels (tests/cpu_kernels.py), with
the backend selected as on CUDA: 0. the kernels against float64; 1. the model under bf16 autocast, each kernel against
SDPA; 2. float32 never reaches a kernel; 3. eval.py and cka.py through the kernels (train.py: tests/test_compile.py);
4. eval.py under torchrun when the last batch has fewer examples than ranks (it used to hang).
"""

import json
import os
import random
import subprocess

import pytest
import torch
from torch.nn.attention.varlen import AuxRequest

import cka
import cpu_kernels
import eval as eval_script
from data import prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM, cu_seqlens_of
from support.tokenizer import train_bpe
from test_model import SPECIAL, padded_batch, randomize_, small_config
from test_train import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A GPU user's own flash-attn is left as it is; tests/test_gpu.py runs it on the GPU.
needs_flash = pytest.mark.skipif(cpu_kernels.flash_attn_varlen_func is None, reason=cpu_kernels.NO_FLASH)
FLASH = pytest.param("flash", marks=needs_flash)


def randomized(config, seed=0):
    torch.manual_seed(seed)
    return randomize_(ModernBertForMaskedLM(config), seed)


def run_model(model, backend, causal, padded, lengths, seed=1, dtype=torch.bfloat16):
    """Forward (under bf16 autocast unless dtype is float32) + backward of a weighted logit sum (none under no_grad),
    on the model's device (tests/test_gpu.py: CUDA) -> (float logits of the real tokens, {name: grad}). Not padded:
    the real tokens of the padded batch, flat, with their cu_seqlens."""
    model.config.attn_backend = backend
    model.zero_grad()
    device = next(model.parameters()).device
    model.place(device, dtype)  # the kernels chosen for `backend`, as a script places the model
    ids, mask = (t.to(device) for t in padded_batch(model.config.vocab_size, lengths, seed))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if padded:
            logits = model(ids, mask, causal=causal)[mask.bool()]  # (T, V): real tokens only
        else:
            logits = model(ids[mask.bool()], causal=causal, cu_seqlens=cu_seqlens_of(lengths).to(device),
                           max_seqlen=max(lengths))
    logits = logits.float()
    if torch.is_grad_enabled():
        (logits * torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed)).to(device)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -----------------------------------------------------------------------------
# 0. The kernels, through their wrappers


def reference(q, k, v, lengths, left, right, scale):
    """float64, per sequence, the window written out: -> (out, lse (heads, T))."""
    out, lse = [], []
    for x in zip(*(t.double().split(lengths) for t in (q, k, v))):
        qs, ks, vs = (t.transpose(0, 1) for t in x)  # (heads, L, hd)
        i = torch.arange(qs.shape[1])
        key_minus_query = i[None, :] - i[:, None]
        ok = (key_minus_query >= -left if left >= 0 else True) & (key_minus_query <= right if right >= 0 else True)
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(~torch.as_tensor(ok), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        lse.append(scores.logsumexp(-1))
    return torch.cat(out), torch.cat(lse, 1)


@pytest.mark.parametrize("kernel", [FLASH, "varlen"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (False, (3, 3)), (True, (-1, -1)), (True, (3, 3)),
                                            (False, (30, 30))])  # a window longer than any sequence: unlimited
def test_kernel_through_its_wrapper_matches_float64(kernel, causal, window):
    lengths, scale = [1, 6, 13, 9], 0.3
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(sum(lengths), 2, 16, generator=g, dtype=torch.float64) for _ in range(4))
    left, right = window[0], 0 if causal else window[1]
    cu = cu_seqlens_of(lengths)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    if kernel == "flash":
        out, lse, _ = cpu_kernels.flash_attn_varlen_func(qb, kb, vb, cu, cu.clone(), 13, 13, softmax_scale=scale,
                                                         causal=causal, window_size=window, return_attn_probs=True)
    else:
        out, lse = cpu_kernels.varlen_attn(qb, kb, vb, cu, cu, 13, 13, scale=scale, window_size=(left, right),
                                           return_aux=AuxRequest(lse=True))
    grads = torch.autograd.grad(out, (qb, kb, vb), dout.bfloat16())
    q, k, v = (t.bfloat16().double().requires_grad_() for t in (q, k, v))  # the same bf16 inputs
    ref, ref_lse = reference(q, k, v, lengths, left, right, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.bfloat16().double())
    assert (out.double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (lse.double() - ref_lse).abs().max() <= 1e-4 * ref_lse.abs().max()  # float32, from bf16 inputs
    for a, b in zip(grads, ref_grads):
        assert (a.double() - b).norm() <= 0.01 * b.norm()


# -----------------------------------------------------------------------------
# 1-2. The model


@pytest.mark.parametrize("backend", [FLASH, "varlen"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [True, False])
def test_model_through_each_kernel_matches_sdpa(monkeypatch, backend, causal, padded):
    """A local window (+-4) shorter than most sequences; one longer than them all: test_kernel_through_its_wrapper."""
    cpu_kernels.install(monkeypatch, backends=(backend,))
    config = small_config("long_seqs", num_hidden_layers=3)
    model = randomized(config).train()  # training mode: the backend is chosen as in a training step
    lengths = [1, 5, 37, 20] if padded else [24, 24, 24]  # packed windows all have the same length
    out, grads = run_model(model, backend, causal, padded, lengths)
    seen = cpu_kernels.calls[backend]
    assert len(seen) == config.num_hidden_layers, "the kernel did not run in every layer"
    want = {(-1, 0), (4, 0)} if causal else {(-1, -1), (4, 4)}
    assert {c["window"] for c in seen} == want and {c["dtype"] for c in seen} == {torch.bfloat16}
    ref, ref_grads = run_model(model, "sdpa", causal, padded, lengths)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 0.03 * g.norm() + 1e-6, name


@needs_flash
def test_float32_forward_never_reaches_a_kernel(monkeypatch):
    """Without autocast the kernels would get float32 q, k, v and raise on CUDA: a model not placed chooses its
    kernels at its first forward in a dtype, again when it runs in another."""
    cpu_kernels.install(monkeypatch)
    model = randomized(small_config("long_seqs", num_hidden_layers=2))
    ids = torch.randint(3, 256, (2, 9))
    model(ids)  # auto: SDPA
    assert str(model.model.kernels.of(packed=True)) == "sdpa"
    assert not cpu_kernels.calls["flash"] and not cpu_kernels.calls["varlen"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    assert str(model.model.kernels.of(packed=True)) == "global cudnn, local flash" and cpu_kernels.calls["flash"]
    model(ids)  # float32 again
    assert str(model.model.kernels.of(packed=True)) == "sdpa"
    for backend in ("flash", "varlen", "cudnn"):
        model.config.attn_backend = backend
        model.place("cpu")
        with pytest.raises(RuntimeError, match="float16 or bfloat16.*--dtype=bfloat16"):
            model(ids)


@needs_flash
def test_bad_kernel_inputs_are_caught():
    """The emulation raises where the kernels do: a harness that accepted anything would prove nothing."""
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    cpu_kernels.varlen_attn(q, q, q, cu, cu, 6, 6)
    for bad, match in [((q.float(), q.float(), q.float(), cu, cu, 6, 6), "fp16 and bf16"),
                       ((q, q, q, cu.long(), cu.long(), 6, 6), "int32"),
                       ((q, q, q, cu, cu, 5, 5), "max_seqlen 5 < longest"),
                       ((q.transpose(1, 2).contiguous().transpose(1, 2), q, q, cu, cu, 6, 6), "contiguous last")]:
        with pytest.raises((RuntimeError, TypeError), match=match):
            cpu_kernels.varlen_attn(*bad)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        cpu_kernels.flash_attn_varlen_func(q.float(), q.float(), q.float(), cu, cu, 6, 6)


# -----------------------------------------------------------------------------
# 3. The scripts, in this process, through the kernels


def through(main, argv, backends=("flash", "varlen")):
    """main(argv) with the kernels of `backends` present, as on a GPU -> {kernel: the dtypes it received}."""
    with pytest.MonkeyPatch.context() as mp:
        cpu_kernels.install(mp, backends)
        main(argv)
    return {kernel: {c["dtype"] for c in seen} for kernel, seen in cpu_kernels.calls.items()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Token shards, a tiny checkpoint with their tokenizer, and a separable classification task."""
    tmp = tmp_path_factory.mktemp("gpu_path")
    rng = random.Random(0)
    warm, cold = ["red", "yellow", "pink", "orange"], ["blue", "cyan", "grey", "black"]
    docs = [" ".join(rng.choice(warm + cold) for _ in range(rng.randint(4, 30))) for _ in range(600)]
    (tmp / "corpus.txt").write_text("\n".join(docs))
    train_bpe(iter(docs), 300, str(tmp / "tokenizer.json"))
    prepare(lambda: read_documents([str(tmp / "corpus.txt")]), str(tmp / "tokenizer.json"), str(tmp / "shards"),
            val_docs=60)
    config = ModernBertConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=2, local_attention=8, **SPECIAL)
    for name, seed in (("a", 0), ("b", 1)):
        randomized(config, seed).save_pretrained(tmp / name)
        (tmp / name / "tokenizer.json").write_bytes((tmp / "tokenizer.json").read_bytes())
    os.makedirs(tmp / "task")
    for split, n in (("train", 33), ("validation", 16), ("test", 16)):  # 33 = 2 x 16 + 1: a last batch of one
        with open(tmp / "task" / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                label = rng.choice(["warm", "cold"])
                text = " ".join(rng.choice(warm if label == "warm" else cold) for _ in range(rng.randint(3, 12)))
                f.write(json.dumps({"text": text, "label": label}) + "\n")
    return tmp


def train_losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(m["step"], m["loss"], m.get("val_mlm_loss")) for m in map(json.loads, f)]


def eval_args(tiny, out, *extra):
    return ["--model", str(tiny / "a"), "--task", "cls", "--data", str(tiny / "task"), "--seeds", "3", "--epochs", "2",
            "--lr", "1e-3", "--device", "cpu", "--out", str(out), *extra]


def results(out):
    with open(out / "results.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def eval_default(tiny, tmp_path_factory):
    """eval.py with its defaults (batch 16: a last batch of one example) and both kernels present."""
    out = tmp_path_factory.mktemp("eval_default")
    seen = through(eval_script.main, eval_args(tiny, out))
    return results(out), seen


@needs_flash
def test_eval_through_the_kernels(tiny, eval_default, tmp_path):
    """Defect 1: eval.py ran its model in float32 and handed float32 q, k, v to the kernel."""
    res, seen = eval_default  # no --dtype: float32 on CPU must not reach the kernel
    assert res["settings"]["model_info"]["code"].endswith("attention sdpa") and not seen["flash"]
    seen = through(eval_script.main, eval_args(tiny, tmp_path / "bf16", "--dtype", "bfloat16"))
    res_bf16 = results(tmp_path / "bf16")
    assert res_bf16["settings"]["model_info"]["code"].endswith("attention flash")
    assert seen["flash"] == {torch.bfloat16}
    through(eval_script.main, eval_args(tiny, tmp_path / "sdpa", "--dtype", "bfloat16"), backends=())
    ref = results(tmp_path / "sdpa")
    for got in (res_bf16, res):
        for a, b in zip(got["runs"][0]["epochs"], ref["runs"][0]["epochs"]):
            assert abs(a["validation"]["macro_f1"] - b["validation"]["macro_f1"]) <= 0.07


@needs_flash
def test_cka_through_the_kernels(tiny, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text((tiny / "corpus.txt").read_text())
    args = ["--pair", str(tiny / "a"), str(tiny / "b"), "--control", str(tiny / "a"), str(tiny / "a"),
            "--texts", str(texts), "--n", "40", "--seeds", "1,2", "--device", "cpu", "--dtype", "bfloat16"]
    assert through(cka.main, [*args, "--out", str(tmp_path / "bf16")])["flash"] == {torch.bfloat16}
    through(cka.main, [*args, "--out", str(tmp_path / "sdpa")], backends=())
    got, ref = (results(tmp_path / k) for k in ("bf16", "sdpa"))
    for layer, e in got["layers"].items():
        assert abs(e["pair_cka"]["mean"] - ref["layers"][layer]["pair_cka"]["mean"]) <= 0.01


# -----------------------------------------------------------------------------
# 4. eval.py under torchrun, a last batch of one example (33 = 2 x 16 + 1)


def test_eval_torchrun_last_batch_smaller_than_world(tiny, eval_default, tmp_path):
    one, _ = eval_default
    cmd = [*launcher(2), os.path.join(ROOT, "eval.py"), *eval_args(tiny, tmp_path / "two")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240,  # it hung before the fix
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    two = results(tmp_path / "two")
    assert two["settings"]["world_size"] == 2
    for a, b in zip(one["runs"][0]["epochs"], two["runs"][0]["epochs"]):
        assert a["validation"] == b["validation"]
    assert one["runs"][0]["test"] == two["runs"][0]["test"]
