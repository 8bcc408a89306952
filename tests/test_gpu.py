"""On a CUDA GPU: every attention backend available against SDPA (SDPA's cuDNN kernel among them), a training
step's gradients eager and compiled against float32, train.py with each backend, and exact resume with dropout on.
Skipped without CUDA (tests/test_gpu_path.py runs the same paths on CPU through the real wrappers on emulated
kernels, tests/cpu_kernels.py).

    python -m pytest tests/test_gpu.py -q -s     # -s prints the measured differences
"""

import os
import shutil
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from model import ModernBertConfig
from support import kernels
from test_gpu_path import SPECIAL, randomized, run_model, tiny, train_losses  # noqa: F401 (tiny is a fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (no CUDA device here)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = [b for b, fn in (("flash", kernels.flash_attn_varlen_func), ("varlen", kernels.varlen_attn)) if fn is not None]
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=3, num_attention_heads=2,
              local_attention=16, **SPECIAL)  # head_dim 64, as ModernBERT's


def worst(a, ga, b, gb):
    logit = ((a - b).abs().max() / b.abs().max()).item()
    grad = max(((ga[n] - gb[n]).norm() / gb[n].norm().clamp_min(1e-12)).item() for n in gb)
    return logit, grad


# (backend, causal, padded, window): each kernel everywhere; SDPA's cuDNN kernel where it attends (the global layers
# of packed batches); SDPA itself in bf16
KERNEL_CASES = [(b, c, p, w) for b in KERNELS for c in (False, True) for p in (True, False) for w in (16, 4096)]
AGAINST_SDPA = (KERNEL_CASES or [pytest.param("none", False, True, 16, marks=pytest.mark.skip(
    reason="no GPU attention kernel here (flash-attn not installed, torch varlen_attn without window_size)"))]) + [
    ("global=cudnn,local=sdpa", c, False, 16) for c in (False, True)] + [("sdpa", True, True, 16)]


@pytest.mark.parametrize("backend, causal, padded, window", AGAINST_SDPA)
def test_each_backend_in_bf16_against_sdpa(backend, causal, padded, window):
    """bf16 against SDPA in float32 (the reference); a kernel also against SDPA in bf16 (the same arithmetic)."""
    model = randomized(ModernBertConfig(**{**CONFIG, "local_attention": window})).cuda().train()
    lengths = [1, 9, 300, 77] if padded else [256, 256]
    out = run_model(model, backend, causal, padded, lengths)
    for ref_dtype in [torch.float32] + [torch.bfloat16] * (backend in KERNELS):
        logit, grad = worst(*out, *run_model(model, "sdpa", causal, padded, lengths, dtype=ref_dtype))
        print(f"{backend} causal={causal} padded={padded} window={window}: vs SDPA {str(ref_dtype)[6:]} max rel "
              f"logit {logit:.2e} grad {grad:.2e}")
        assert logit <= 0.02 and grad <= 0.03


PROCESS = SimpleNamespace(device=torch.device("cuda"), world=1)  # train.forward_backward's, one process


def mlm_batch(config, rate=0.3, length=256, seed=0):
    """4 sequences of `length` random tokens, `rate` of them masked, as train.py builds a batch."""
    import data
    from support.tokenizer import SPECIAL_NAMES

    special = {name: i for i, name in enumerate(SPECIAL_NAMES)}
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(len(special), config.vocab_size, (4, length), generator=g)
    return data.mlm_batch(tokens, rate, special, config.vocab_size, seed=[0, seed])


# How train.py's step may run on a GPU: torch.compile backend (None: eager), inductor settings, and whether the
# loss is computed in the model's graph (train.forward_backward) or outside it, by F.cross_entropy on the logits.
STEP_VARIANTS = {
    "eager": (None, {}, True),
    "aot_eager": ("aot_eager", {}, True),
    "inductor": ("inductor", {}, True),
    "inductor, no mix-order reduction": ("inductor", {"triton.mix_order_reduction": False}, True),
    "inductor, loss outside the graph": ("inductor", {}, False),
}


def test_train_step_gradients_against_float32():
    """train.forward_backward's gradients under bf16 autocast, as each variant computes them, against one eager
    float32 step with F.cross_entropy on the logits (the chunked loss not involved). Under torch 2.11 every gradient
    of a compiled step was zero (pytorch#180642, see support/kernels.py): the variants say whether such a fault is
    eager's, dynamo's or AOTAutograd's (aot_eager), inductor's code, its mix-order reductions, or the chunked
    loss's in the graph."""
    import torch._inductor.config as inductor
    import torch.nn.functional as F

    import train

    config = ModernBertConfig(**CONFIG)
    batch = mlm_batch(config)
    model = randomized(config).to(PROCESS.device).train()
    b = batch.to(PROCESS.device)

    def loss_outside(m):
        logits = m(b.tokens, cu_seqlens=b.cu_seqlens, max_seqlen=b.max_seqlen, rows=b.rows)
        loss = F.cross_entropy(logits.float(), b.targets)
        loss.backward()
        return loss.detach()

    ref_loss = loss_outside(model)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.place(PROCESS.device, torch.bfloat16)  # the kernels of the steps below, as train.py chooses them
    failures = []
    for name, (backend, settings, in_graph) in STEP_VARIANTS.items():
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        step_model = (model if backend is None else kernels.compile_model(model) if backend == "inductor" else
                      torch.compile(model, backend=backend))
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        with inductor.patch(settings):
            if in_graph:
                loss = train.forward_backward(step_model, [batch], False, PROCESS, autocast)
            else:
                with autocast:
                    loss = loss_outside(step_model)
        grads = {n: p.grad for n, p in model.named_parameters()}
        errors = {n: 1.0 if grads[n] is None else ((grads[n] - g).norm() / g.norm()).item() for n, g in ref.items()}
        zero = [n for n in ref if grads[n] is None or not grads[n].any()]
        worst = max(errors, key=errors.get)
        loss_error = abs(loss.item() / ref_loss.item() - 1)
        print(f"{name}: loss rel err {loss_error:.1e}; gradients' rel err median "
              f"{statistics.median(errors.values()):.1e}, worst {errors[worst]:.1e} ({worst}); {len(zero)} of "
              f"{len(ref)} None or all zero {zero[:4]}")
        if loss_error > 0.02 or errors[worst] > 0.05:
            failures.append(name)
    assert not failures, f"gradients off float32's: {failures}"


def test_compiled_steps_move_the_weights_as_eager_steps_do():
    """Three steps of train.py's loop on one batch (forward_backward, then its fused AdamW), eager and compiled
    from the same weights: the loss falls alike and the weights move alike (a compiled step whose update never
    reaches the weights, or whose gradients vanish, shows here even where one step's gradients look right)."""
    import copy

    import train

    config = ModernBertConfig(**CONFIG)
    batch = mlm_batch(config)
    start = randomized(config).place(PROCESS.device, torch.bfloat16).train()
    runs = {}
    for compiled in (False, True):
        model = copy.deepcopy(start)
        optimizer = train.make_optimizer(model, train.Config(lr=1e-3), PROCESS.device)
        torch._dynamo.reset()
        step_model = kernels.compile_model(model) if compiled else model
        losses, moved = [], []
        for _ in range(3):
            losses.append(train.forward_backward(step_model, [batch], False, PROCESS,
                                                 torch.autocast("cuda", dtype=torch.bfloat16)).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            moved.append(max(((p - q).norm() / q.norm()).item()
                             for p, q in zip(model.parameters(), start.parameters())))
        runs[compiled] = losses, moved
        print(f"{'compiled' if compiled else 'eager'}: losses {[round(x, 4) for x in losses]}, largest relative "
              f"weight change after each step {[f'{x:.1e}' for x in moved]}")
    (eager_loss, eager_moved), (loss, moved) = runs[False], runs[True]
    assert all(abs(a / b - 1) <= 0.02 for a, b in zip(loss, eager_loss))
    assert all(0.5 <= a / b <= 2 for a, b in zip(moved, eager_moved))


def test_a_new_mask_rate_compiles_no_new_graph():
    """The MLM head's row count changes every step and with the mask rate (30% -> 15% in the decay): one graph
    for all, through train.py's wrap and forward_backward. Inductor's Triton fusion of LayerNorm backward guards on
    the rows it fuses (rows x hidden >= 5 x 2^20) unless support.kernels.compile_model turns that off; at hidden
    768, 30% of 4 x 8192 rows lie above, 15% below."""
    from torch._dynamo.utils import counters

    import train

    torch._dynamo.reset()
    counters.clear()
    config = ModernBertConfig(**{**CONFIG, "hidden_size": 768, "intermediate_size": 1152, "num_attention_heads": 12})
    model = train.wrap(randomized(config).place(PROCESS.device, torch.bfloat16).train(),
                       SimpleNamespace(device=PROCESS.device, compiled="inductor"))
    for step, rate in enumerate((0.3, 0.15, 0.3)):
        batch = mlm_batch(config, rate, length=8192, seed=step)
        train.forward_backward(model, [batch], False, PROCESS, torch.autocast("cuda", dtype=torch.bfloat16))
    graphs = counters["stats"]["unique_graphs"]
    print(f"MLM at 30%, 15%, 30% of 4 x 8192 tokens, compiled: {graphs} graph(s)")
    assert graphs == 1


def train(tiny, out, *extra, wrapper=None):  # noqa: F811
    args = [f"--data_dir={tiny / 'shards'}", f"--init_from={tiny / 'a'}", f"--out_dir={out}", "--seq_len=32",
            "--global_batch_size=4", "--micro_batch_size=2", f"--tokens={8 * 4 * 32}", "--warmup_tokens=0",
            "--lr=1e-3", "--decay_frac=0.25", "--log_interval=1", "--eval_interval=4", "--eval_windows=4",
            "--ckpt_interval=4", "--device=cuda", *extra]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args] if wrapper is None else \
        [sys.executable, "-c", wrapper, os.path.join(ROOT, "train.py"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def float32_run(tiny, tmp_path_factory):  # noqa: F811
    """The reference of the runs below: train.py eager, SDPA, float32."""
    out = tmp_path_factory.mktemp("float32")
    train(tiny, out, "--attn_backend=sdpa", "--attn_out_dropout=0.0", "--dtype=float32", "--compile=False")
    return train_losses(out)


@pytest.mark.parametrize("backend", ["auto", *KERNELS, "sdpa"])
def test_train_steps_with_each_backend(tiny, tmp_path, float32_run, backend):  # noqa: F811
    """train.py compiled, bf16, with each backend ("auto": cuDNN in the global layers, a kernel in the local ones),
    against the float32 eager run: the same steps, losses within bf16 noise (a run that does not learn stays at its
    first losses: 8% off by step 10 at this lr)."""
    train(tiny, tmp_path, f"--attn_backend={backend}", "--attn_out_dropout=0.0", "--compile=True")
    got, ref = train_losses(tmp_path), float32_run
    diff = max(abs(a - b) / abs(b) for (_, a, _), (_, b, _) in zip(got, ref))
    print(f"train.py {backend} bf16 compiled vs sdpa fp32 eager: max rel loss diff {diff:.2e}")
    assert [s for s, _, _ in got] == [s for s, _, _ in ref] and diff <= 0.03, \
        "losses (step, bf16 compiled, float32 eager): " + ", ".join(
            f"({s}, {a:.4f}, {b:.4f})" for (s, a, _), (_, b, _) in zip(got, ref))


# Bit-exact runs need deterministic kernels: SDPA's math backend and torch's deterministic mode
# (flash and memory-efficient attention backward accumulate with atomics in a varying order).
DETERMINISTIC = ("import runpy, sys, torch; from torch.nn.attention import sdpa_kernel, SDPBackend; "
                 "torch.use_deterministic_algorithms(True); sdpa_kernel(SDPBackend.MATH).__enter__(); "
                 "sys.argv = sys.argv[1:]; sys.path.insert(0, '.'); runpy.run_path(sys.argv[0], run_name='__main__')")


def test_resume_is_bit_exact_on_cuda_with_dropout(tiny, tmp_path):  # noqa: F811
    """CUDA dropout draws from the CUDA generator: a resume must restore it, per rank."""
    dropout = ["--attn_backend=sdpa", "--attn_out_dropout=0.1", "--attention_dropout=0.1", "--mlp_dropout=0.1"]
    train(tiny, tmp_path / "whole", *dropout, wrapper=DETERMINISTIC)
    resumed = tmp_path / "resumed"
    os.makedirs(resumed)
    shutil.copytree(tmp_path / "whole" / "ckpt-4", resumed / "ckpt-4")
    shutil.copy(tmp_path / "whole" / "metrics.jsonl", resumed / "metrics.jsonl")
    r = train(tiny, resumed, *dropout, wrapper=DETERMINISTIC)
    assert "resuming at step 4" in r.stdout
    whole, again = train_losses(tmp_path / "whole"), train_losses(resumed)
    print(f"resume on CUDA: {len(whole)} logged steps, identical: {whole == again}")
    assert whole == again
