"""torch.compile as train.py uses it on GPU, checked on CPU: graphs compiled (dynamo's counters, with aot_eager: the
same tracing and guards as inductor, without its C++ build) through each kernel's real wrapper, no graph break,
compiled = eager, regional compilation; the chunked loss and the prefetch thread around it."""

import contextlib
import copy
import dataclasses
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.autograd_cache import check_cacheable
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

import cpu_kernels
import data
import train
from model import ModernBertConfig, ModernBertForSequenceClassification, cu_seqlens_of
from support import kernels
from support.kernels import chunked_cross_entropy
from test_train import launcher
from test_gpu_path import SPECIAL, needs_flash, randomized, tiny, train_losses  # noqa: F401 (tiny is a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each process prints its graph count on exit (train.py's end line says rank 0's alone), in one os.write: print()'s
# pieces of two ranks could interleave on the shared pipe under PYTHONUNBUFFERED.
COUNTED = ("import atexit, os, runpy, sys; from torch._dynamo.utils import counters; "
           "atexit.register(lambda: os.write(2, f\"compiled graphs {counters['stats']['unique_graphs']} graph breaks "
           "{sum(counters['graph_break'].values())}\\n\".encode())); "
           "sys.argv = sys.argv[1:]; sys.path.insert(0, '.'); runpy.run_path(sys.argv[0], run_name='__main__')")


def run_args(tiny, out, **over):
    """A CLM phase of 2 steps, then an MLM decay of 10: the mask flips once, the target count moves."""
    args = dict(data_dir=tiny / "shards", init_from=tiny / "a", out_dir=out, seq_len=32, global_batch_size=4,
                micro_batch_size=2, tokens=2 * 4 * 32, warmup_tokens=0, lr=1e-3, decay_frac=5.0, log_interval=4,
                eval_interval=100, eval_windows=4, ckpt_interval=100, device="cpu", attn_out_dropout=0.0)
    return [f"--{k}={v}" for k, v in {**args, **over}.items()]


def small(layers, **kw):
    return randomized(ModernBertConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                       num_attention_heads=2, local_attention=8, **SPECIAL, **kw))


def assert_grads_close(grads, ref_grads):
    for n, gr in ref_grads.items():
        assert (grads[n] - gr).abs().max() <= 1e-5 * gr.abs().max() + 1e-7, n


@contextlib.contextmanager
def own_signal_handlers():
    """train.main installs SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


keep_signal_handlers = pytest.fixture(own_signal_handlers)
EACH_KERNEL = dict(tokens=4 * 32, decay_frac=3.0)  # 1 CLM step, 3 MLM steps, 2 micro batches each


@pytest.fixture(scope="module")
def eager_float32(tiny, tmp_path_factory):  # noqa: F811
    """The reference of the compiled runs through each kernel: train.py eager in float32, the kernels present, which
    never see it (they reject float32: SDPA)."""
    out = tmp_path_factory.mktemp("eager")
    with pytest.MonkeyPatch.context() as mp, own_signal_handlers():
        cpu_kernels.install(mp)
        train.main(run_args(tiny, out, compile=False, dtype="float32", **EACH_KERNEL))
    assert not any(cpu_kernels.calls.values())
    return train_losses(out)


@pytest.mark.parametrize("kernel", [pytest.param("flash", marks=needs_flash), "varlen", "cudnn"])
def test_a_run_through_each_kernel_compiles_one_graph_per_mask(tiny, tmp_path, monkeypatch, keep_signal_handlers,
                                                               capsys, eager_float32, kernel):
    """The real wrappers (tests/cpu_kernels.py) under torch.compile and bf16 autocast, CLM then MLM: two graphs
    (causal, bidirectional), none per MLM target count, no graph break, the training and validation losses of an
    eager float32 run. flash-attn broke the graph at every layer when model.py gave it one tensor as both
    cu_seqlens_q and _k. cudnn: "auto" on a GPU without flash-attn, SDPA's CPU flash kernel standing in for cuDNN's,
    varlen_attn locally. (SDPA: test_ddp_of_...)"""
    cpu_kernels.install(monkeypatch, backends=("varlen",) if kernel == "cudnn" else (kernel,))
    torch._dynamo.reset()
    counters.clear()
    backend = "auto" if kernel == "cudnn" else kernel
    train.main(run_args(tiny, tmp_path, compile="aot_eager", attn_backend=backend, dtype="bfloat16", **EACH_KERNEL))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    if kernel == "cudnn":  # test_kernels checks the cuDNN layers' SDPA call
        assert "attention global cudnn, local varlen" in capsys.readouterr().out and cpu_kernels.calls["varlen"]
    else:
        assert {c["causal"] for c in cpu_kernels.calls[kernel]} == {True, False}  # the kernel ran, both masks
    assert (graphs, breaks) == (2, 0)
    got, ref = train_losses(tmp_path), eager_float32
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] and any(v is not None for _, _, v in ref)
    for (_, a, val_a), (_, b, val_b) in zip(got, ref):
        assert abs(a - b) <= 1e-3 * abs(b) and (val_b is None or abs(val_a - val_b) <= 0.02 * abs(val_b))


def test_ddp_of_the_compiled_model_under_torchrun(tiny, tmp_path):
    """SDPA, 2 CLM steps then 10 MLM: each rank compiles one graph per mask, none per MLM target count, no break."""
    cmd = [*launcher(2), "--no-python", sys.executable, "-c", COUNTED, os.path.join(ROOT, "train.py"),
           *run_args(tiny, tmp_path / "ddp", compile="aot_eager")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    per_rank = [tuple(map(int, m)) for m in re.findall(r"compiled graphs (\d+) graph breaks (\d+)", r.stderr)]
    assert per_rank == [(2, 0), (2, 0)]


def mlm_step(model, run, causal=False, seed=0):
    """run (the model, or a compiled form of it) on 3 sequences of 24 tokens, 20 of them MLM targets: forward and
    backward -> (loss, {name: the model's gradient})."""
    g = torch.Generator().manual_seed(seed)
    tokens, rows = torch.randint(3, 256, (3 * 24,), generator=g), torch.randperm(72, generator=g)[:20].sort().values
    model.zero_grad()
    loss = run(tokens, causal=causal, cu_seqlens=torch.tensor([0, 24, 48, 72], dtype=torch.int32), max_seqlen=24,
               rows=rows, targets=tokens[rows])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_inductor_step_equals_eager_and_aot_autograds_cache_admits_it():
    """One MLM forward + backward through compile_model's inductor (C++ on CPU) against eager, float32; the layers'
    kernels read RoPE's tables and compute no cos or sin (which inductor would recompute per element of q and k in
    every layer). A resumed run loads its graphs from inductor's caches, but AOTAutograd's cache refuses a graph that
    calls an autograd.Function (the chunked loss) unless compile_model allows it: torch's own check on the graph."""
    graphs = []

    def backend(gm, example_inputs):  # inductor, keeping the graph it receives
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    model = small(2)
    torch._dynamo.reset()
    (loss, grads), code = run_and_get_code(mlm_step, model, kernels.compile_model(model, backend))
    ref, ref_grads = mlm_step(model, model)
    assert abs(loss - ref) <= 1e-5 * abs(ref)
    assert not re.search(r"\b(cos|sin)\(", "\n".join(code))
    assert_grads_close(grads, ref_grads)
    assert len(graphs) == 1 and "autograd_function_apply" in graphs[0].code
    check_cacheable(graphs[0])  # raises BypassAOTAutogradCache where the cache would not take it


def test_regional_compilation_compiles_a_graph_per_kind_of_block():
    """compile_model(regional=True): each Block and the loss compiled in place. The 7 layers compile a graph per kind
    of block (layer 0, with no attention norm; global; local), the loss one, the causal mask at most 3 more; no graph
    break; the MLM loss and every gradient as eager's."""
    model, eager = small(7), small(7)
    kernels.compile_model(model, "aot_eager", regional=True)
    torch._dynamo.reset()
    counters.clear()
    for causal, graphs in ((False, {4}), (True, {5, 6, 7})):
        (loss, grads), (ref, ref_grads) = (mlm_step(m, m, causal, seed=int(causal)) for m in (model, eager))
        assert counters["stats"]["unique_graphs"] in graphs and not counters["graph_break"]
        assert abs(loss - ref) <= 1e-5 * abs(ref)
        assert_grads_close(grads, ref_grads)


def test_regional_compilation_of_a_classifier_compiles_its_blocks():
    """bench.py's fine-tuning row: a classifier, which has no chunked loss, compiled regionally; logits as eager's."""
    config = dataclasses.replace(small(3).config, id2label={"0": "a", "1": "b"})
    torch.manual_seed(0)
    model = ModernBertForSequenceClassification(config)
    eager = copy.deepcopy(model)
    kernels.compile_model(model, "aot_eager", regional=True)
    tokens, cu = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(0)), cu_seqlens_of([12, 8])
    logits, ref = (m(tokens, cu_seqlens=cu, max_seqlen=12) for m in (model, eager))
    assert logits.shape == (2, 2) and torch.allclose(logits, ref, atol=1e-5)


def test_the_chunked_loss_returns_a_tensor_never_updated_in_place():
    """torch 2.11's dynamo gives a zero gradient to an autograd.Function's output that its forward updated in place
    (pytorch#180642): a GPU run would never train. Later versions pass the inductor step test regardless."""
    x, weight, bias = torch.randn(50, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True), torch.zeros(64)
    loss = chunked_cross_entropy(x, weight, bias, torch.randint(0, 64, (50,)), chunk_rows=16)  # 4 chunks
    assert loss._version == 0


@pytest.mark.parametrize("causal", [False, True])
def test_sequences_of_different_lengths_compiled_equal_eager(causal):
    """SDPA: eager attends each sequence alone, compiled on a padded (B, S) view with a padding mask; logits and
    gradients agree. Over batches of other lengths, the first batch's graph, then one dynamic graph, no graph break
    (a break recompiles the code after it at every new length: 0.08x eager's speed in bench's variable CLM)."""
    model = small(3, attn_backend="sdpa")

    def run(m, lengths):
        model.zero_grad()
        tokens = torch.randint(3, 256, (sum(lengths),), generator=torch.Generator().manual_seed(len(lengths)))
        logits = m(tokens, causal=causal, cu_seqlens=cu_seqlens_of(lengths), max_seqlen=max(lengths))
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    for lengths in ([5, 30, 12], [7, 41], [3, 9, 22, 18], [26, 4, 11]):
        logits, grads = run(compiled, lengths)
        ref, ref_grads = run(model, lengths)
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
        assert_grads_close(grads, ref_grads)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


def test_prefetch_keeps_the_stream_and_raises_at_the_step():
    def produce(step):
        if step == 7:
            raise ValueError("no data for step 7")
        return torch.randn(3, generator=torch.Generator().manual_seed(step))

    stream = data.prefetch(produce, range(3, 10))
    for step in range(3, 7):
        assert torch.equal(next(stream), torch.randn(3, generator=torch.Generator().manual_seed(step)))
    with pytest.raises(ValueError, match="step 7"):
        next(stream)


@pytest.mark.parametrize("freeze_phase", ["main", "decay"])
def test_a_frozen_phase_compiles_without_breaks_and_keeps_the_frozen_weights(tiny, tmp_path, keep_signal_handlers,
                                                                             freeze_phase):
    """Layer 0's weights stop requiring gradients at the boundary, a guard the compiled graph must see (a stale graph
    would still compute, or apply, their gradients): no graph break, a graph per (mask, frozen set) at most, and the
    frozen weights bit-identical across the frozen phase."""
    torch._dynamo.reset()
    counters.clear()
    out = tmp_path / "frozen"
    train.main(run_args(tiny, out, compile="aot_eager", freeze_layers="0", freeze_phase=freeze_phase, weight_decay=0.1,
                        ckpt_interval=2, max_ckpts=10))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] <= 3
    before, after = ((tiny / "a", out / "ckpt-2") if freeze_phase == "main" else (out / "ckpt-2", out / "final"))
    a, b = (load_file(str(d / "model.safetensors")) for d in (before, after))
    layer0 = [k for k in a if ".layers.0." in k]
    assert layer0 and all(torch.equal(a[k], b[k]) for k in layer0)
    assert any(not torch.equal(a[k], b[k]) for k in a if ".layers.1." in k)  # the others trained
