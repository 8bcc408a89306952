"""train.py on CPU with a tiny model: the one flag, the schedule and phases, freezing, exact resume
after SIGKILL, torchrun = one process, Hugging Face export, clear errors."""

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from data import Loader, clm_batch, load_meta, mlm_batch, prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM
from support.flops import training_flops
from support.tokenizer import train_bpe
from support.distributed import Process
from support.freeze import Freeze
from train import Config, Schedule, batch_loss, forward_backward, make_optimizer, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2, local_attention=16)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Shards of a small synthetic corpus with a trained BPE: enough structure to learn from."""
    tmp = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    nouns, verbs = ["cell", "gene", "protein", "tumor", "patient", "dose", "virus"], ["binds", "inhibits",
                                                                                      "expresses", "treats"]
    docs = [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} a {rng.choice(nouns)}."
                     for _ in range(rng.randint(1, 6))) for _ in range(3000)]
    (tmp / "corpus.txt").write_text("\n".join(docs))
    train_bpe(iter(docs), 300, str(tmp / "tokenizer.json"))
    prepare(lambda: read_documents([str(tmp / "corpus.txt")]), str(tmp / "tokenizer.json"), str(tmp / "shards"),
            val_docs=200)
    return str(tmp / "shards")


@pytest.fixture(scope="module")
def base_ckpt(data_dir, tmp_path_factory):
    """A Hugging Face directory to continue from (random weights, the data's vocab)."""
    meta = load_meta(data_dir)
    path = str(tmp_path_factory.mktemp("base"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"],
                                           sep_token_id=meta["sep_id"], **TINY)).save_pretrained(path)
    return path


def free_port():
    """A port no process listens on now: torchrun's, so that tests running side by side (pytest -n) never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(nproc, torchrun=False):
    """`python` for one process, unless `torchrun`; else torchrun with nproc processes on a port of its own."""
    if nproc == 1 and not torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


def train_cmd(out_dir, data_dir, *overrides, nproc=1):
    """A tiny run: 16 main + 4 decay steps of 8 x 64 tokens, unless overridden."""
    args = [f"--data_dir={data_dir}", f"--out_dir={out_dir}", f"--model_config={TINY!r}", "--seq_len=64",
            "--global_batch_size=8", "--micro_batch_size=4", f"--tokens={16 * 8 * 64}", f"--warmup_tokens={4 * 8 * 64}",
            "--lr=3e-3", "--decay_frac=0.25", "--log_interval=1", "--eval_interval=8", "--eval_windows=16",
            "--ckpt_interval=8", "--device=cpu", *overrides]
    return launcher(nproc) + [os.path.join(ROOT, "train.py"), *args]


def run_train(out_dir, data_dir, *overrides, check=True, env=None, nproc=1):
    r = subprocess.run(train_cmd(out_dir, data_dir, *overrides, nproc=nproc), capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# -----------------------------------------------------------------------------
# 1. One flag: the same model and head give the CLM and the MLM loss


def test_one_flag_losses_equal_reference_cross_entropy(data_dir):
    meta = load_meta(data_dir)
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY)).eval()
    windows = Loader(data_dir, "train", 64, 4, data_seed=1).next()  # (4, 64)
    with torch.no_grad():
        clm = clm_batch(windows, meta["eos_id"])
        ours = batch_loss(model, clm, causal=True) / clm.targets.numel()
        logits = model(windows, causal=True)  # padded entry point, (4, 64, V)
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, 320), windows[:, 1:].reshape(-1))
        assert abs(ours.item() - ref.item()) < 1e-5

        special = {k: meta[k] for k in ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")}
        mlm = mlm_batch(windows, 0.3, special, meta["vocab_size"], seed=[17, 0, 0])
        ours = batch_loss(model, mlm, causal=False) / mlm.targets.numel()
        logits = model(mlm.tokens.view(4, 64))  # bidirectional, on the masked input
        labels = torch.full((4 * 64,), -100)
        labels[mlm.rows] = windows.flatten()[mlm.rows]
        ref = F.cross_entropy(logits.reshape(-1, 320), labels, ignore_index=-100)
        assert abs(ours.item() - ref.item()) < 1e-5


def test_micro_batches_weigh_every_target_alike(data_dir):
    """Gradient accumulation over two MLM micro batches with different target counts gives the loss and
    the gradients of one cross-entropy over all their targets: each micro batch's sum is divided by the
    global batch's target count, not by its own (which would reweight the gradients and inflate the loss)."""
    meta = load_meta(data_dir)
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY)).eval()  # no dropout
    windows = Loader(data_dir, "train", 64, 2, data_seed=1).next()  # (2, 64): one window per micro batch
    special = {k: meta[k] for k in ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")}
    batches = [mlm_batch(windows[i:i + 1], p, special, meta["vocab_size"], seed=[17, 0, i])
               for i, p in enumerate([0.1, 0.5])]
    counts = [b.targets.numel() for b in batches]
    assert counts[0] * 2 < counts[1]  # the micro batches weigh differently
    loss = forward_backward(model, batches, False, Process(0, 1, torch.device("cpu")),
                            torch.autocast("cpu", enabled=False))
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # The reference: one mean cross-entropy over the targets of both micro batches.
    logits = torch.cat([model(b.tokens.view(1, 64)).view(64, 320)[b.rows] for b in batches])  # (N, V)
    ref = F.cross_entropy(logits.double(), torch.cat([b.targets for b in batches]))
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, p in model.named_parameters():
        assert torch.allclose(ours[name], p.grad, rtol=1e-4, atol=1e-7), name


def test_one_step_with_zero_gradients_is_the_decoupled_weight_decay():
    """With zero gradients Adam's update is 0, so one optimizer step is the weight decay alone: each matrix
    times 1 - weight_decay * lr_t / lr (decoupled: relative to the peak lr), biases and norm weights unchanged."""
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))
    c = Config(lr=0.5, weight_decay=0.1)
    optimizer = make_optimizer(model, c, torch.device("cpu"))
    lr_t = 0.2  # somewhere in a decay
    for group in optimizer.param_groups:
        group["lr"] = lr_t
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    factor = 1 - 0.1 * 0.2 / 0.5  # 0.96; torch's own lr_t * weight_decay would give 0.98
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            expect = (before[name].double() * factor).float()
            assert torch.allclose(p.detach(), expect, rtol=1e-6, atol=0), name
        else:
            assert torch.equal(p.detach(), before[name]), f"{name} (1-D) was decayed"


# -----------------------------------------------------------------------------
# 2. Schedule and phases


def test_lr_schedule_matches_the_formulas():
    c = Config(tokens=1000 * 64, warmup_tokens=100 * 64, global_batch_size=1, seq_len=64, decay_frac=0.1,
               lr=2e-4, final_lr_frac=0.1)
    s = Schedule.from_config(c)
    assert (*s.steps, s.warmup_steps[0]) == (1000, 100, 100)
    for step in [0, 1, 49, 99, 100, 500, 999]:
        expect = 2e-4 * min(1, (step + 1) / 100)
        assert s.lr_at(step) == pytest.approx(expect, rel=1e-12)
    for step in [1000, 1001, 1025, 1050, 1099]:  # the 1-sqrt decay: peak * (0.1 + 0.9 * (1 - sqrt(t / T)))
        t = step - 1000
        assert s.lr_at(step) == pytest.approx(2e-4 * (0.1 + 0.9 * (1 - math.sqrt(t / 100))), rel=1e-12)
    assert s.lr_at(999) == 2e-4 and s.lr_at(1000) == 2e-4  # no warmup, no jump at the boundary
    assert s.at(999).name == "main" and s.at(1000).name == "decay"


def test_main_then_decay_equals_all(data_dir, base_ckpt, tmp_path):
    common = [f"--init_from={base_ckpt}"]
    run_train(tmp_path / "all", data_dir, *common)
    run_train(tmp_path / "main", data_dir, *common, "--run_phases=main")
    run_train(tmp_path / "decay", data_dir, f"--init_from={tmp_path / 'main' / 'final'}", "--run_phases=decay")
    whole = [(m["step"], m["loss"]) for m in metrics(tmp_path / "all")]
    split = [(m["step"], m["loss"]) for m in metrics(tmp_path / "main") + metrics(tmp_path / "decay")]
    assert whole == split and whole[-1][0] == 20
    a = load_file(tmp_path / "all" / "final" / "model.safetensors")
    b = load_file(tmp_path / "decay" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The optimizer state carried over the boundary: Adam's step count was never reset.
    state = torch.load(tmp_path / "all" / "final" / "train_state.pt", weights_only=False)["optimizer"]["state"]
    assert {int(v["step"]) for v in state.values()} == {20}
    decay_records = [m for m in metrics(tmp_path / "all") if m["phase"] == "decay"]
    assert decay_records and all(m["objective"] == "mlm" for m in decay_records)


@pytest.mark.parametrize("world", [1, 2])
def test_skip_data_stands_where_an_uninterrupted_run_stands(data_dir, world):
    """After skip_data(N tokens) a fresh loader on each rank gives the windows that a loader which read N tokens
    (5 steps of 8 windows of 64 tokens, on one rank) gives next: the same data, not a replay from window 0."""
    from support.checkpoint import skip_data

    whole = Loader(data_dir, "train", 64, 8, 42)
    for _ in range(5):
        whole.next()
    ahead = [whole.next() for _ in range(3)]  # (8, 64) each: steps 6-8 of the uninterrupted run
    parts = [Loader(data_dir, "train", 64, 8 // world, 42, rank, world) for rank in range(world)]
    assert [skip_data(p, 5 * 8 * 64 + 63) for p in parts] == [5 * 8 * 64] * world  # whole windows only
    resumed = [torch.cat([p.next() for p in parts]) for _ in range(3)]  # the ranks' micro batches, in rank order
    assert all(torch.equal(a, b) for a, b in zip(ahead, resumed))
    fresh = Loader(data_dir, "train", 64, 8, 42).next()
    assert not torch.equal(fresh, ahead[0])  # the replay that skip_data avoids would differ


def test_decay_from_weights_without_train_state_warns_and_skips(data_dir, base_ckpt, tmp_path):
    """The decay alone from a Hugging Face directory: a warning naming --skip_tokens with the uninterrupted run's
    position (16 steps x 8 x 64 tokens); with it, no warning and the loader starts there."""
    r = run_train(tmp_path / "a", data_dir, f"--init_from={base_ckpt}", "--run_phases=decay")
    assert "the data position restarts" in r.stderr and "--skip_tokens=8192 " in r.stderr
    r = run_train(tmp_path / "b", data_dir, f"--init_from={base_ckpt}", "--run_phases=decay", "--skip_tokens=8192")
    assert "restarts" not in r.stderr and "starting 8,192 tokens into the stream (128 windows" in r.stdout
    loader = torch.load(tmp_path / "b" / "final" / "train_state.pt", weights_only=False)["loader"]
    assert loader["consumed"] == 128 + 4 * 8  # skipped, then the 4 decay steps of 8 windows


def test_biphasic_config_runs_its_three_phases_with_one_optimizer_state(data_dir, tmp_path):
    """configs/biphasic_scratch.py, each phase's steps (and warmup) scaled from its 42,000-step budget to 84 tiny
    steps (1/500: 21 CLM with a 4-step warmup, 59 MLM, 4 decay): CLM then MLM at a constant lr, then a 1-sqrt
    decay, and Adam's step count carried across both boundaries."""
    config = os.path.join(ROOT, "configs", "biphasic_scratch.py")
    phases = [{**p, "steps": p["steps"] // 500, **({"warmup_steps": p["warmup_steps"] // 500} if "warmup_steps" in p
                                                  else {})} for p in parse_config([config]).phases]
    run_train(tmp_path, data_dir, config, f"--out_dir={tmp_path}", f"--phases={phases!r}", "--max_ckpts=10")
    records = metrics(tmp_path)
    seen = [(m["phase"], m["objective"]) for m in records]
    assert sorted(set(seen), key=seen.index) == [("clm", "clm"), ("mlm", "mlm"), ("decay", "mlm")]
    assert [m["step"] for m in records] == list(range(1, 85))
    for m in records[:4]:  # the warmup: the record of step s logs the lr of the step from s - 1 to s
        assert m["lr"] == pytest.approx(3e-3 * m["step"] / 4, rel=1e-12)
    assert all(m["lr"] == 3e-3 for m in records[4:] if m["phase"] != "decay")
    for m in records[80:]:
        t = m["step"] - 1 - 80
        assert m["lr"] == pytest.approx(3e-3 * (0.1 + 0.9 * (1 - math.sqrt(t / 4))), rel=1e-12)
    for ckpt, step in [("ckpt-21", 21), ("ckpt-80", 80), ("final", 84)]:  # the ends of the three phases
        state = torch.load(tmp_path / ckpt / "train_state.pt", weights_only=False)["optimizer"]["state"]
        assert {int(v["step"]) for v in state.values()} == {step}


def test_evaluation_follows_eval_interval_not_log_interval(data_dir, base_ckpt, tmp_path):
    """eval_interval 3 with log_interval 4: evaluations at 3, 6, 9, ... and at each phase end (16, 20), each
    logged with the training loss of its step, whether or not it is also a log step."""
    r = run_train(tmp_path / "run", data_dir, f"--init_from={base_ckpt}", "--log_interval=4", "--eval_interval=3")
    records = metrics(tmp_path / "run")
    assert [m["step"] for m in records if "val_mlm_loss" in m] == [3, 6, 9, 12, 15, 16, 18, 20]
    assert [m["step"] for m in records] == [3, 4, 6, 8, 9, 12, 15, 16, 18, 20]
    assert all("loss" in m and "val_clm_loss" in m for m in records if "val_mlm_loss" in m)
    # A record says the seconds its tokens/s leaves out: its evaluation, the checkpoints written since the record
    # before (ckpt-8 after step 8, ckpt-16 after 16); the end line counts them all, ckpt-20 and final included.
    assert [m["step"] for m in records if m.get("eval_s", 0) > 0] == [3, 6, 9, 12, 15, 16, 18, 20]
    assert [m["step"] for m in records if m.get("checkpoint_s", 0) > 0] == [9, 18]
    assert "outside the steps: 8 evaluations in " in r.stdout and ", 4 checkpoints in " in r.stdout, r.stdout[-500:]


# -----------------------------------------------------------------------------
# 3. Freezing: bit-identical frozen layers, everything else trains


@pytest.mark.parametrize("freeze_phase", ["main", "decay"])
def test_frozen_layers_are_bit_identical(data_dir, base_ckpt, tmp_path, freeze_phase):
    run_train(tmp_path, data_dir, f"--init_from={base_ckpt}", "--freeze_layers=0-1", f"--freeze_phase={freeze_phase}",
              "--weight_decay=0.1", "--max_ckpts=10")
    # main ends at step 16: freezing in main compares the start with ckpt-16, in decay ckpt-16 with final
    start, end = (base_ckpt, tmp_path / "ckpt-16") if freeze_phase == "main" else (tmp_path / "ckpt-16", tmp_path / "final")
    before, after = load_file(os.path.join(start, "model.safetensors")), load_file(os.path.join(end, "model.safetensors"))
    for key in before:
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        if layer in ("0", "1"):
            assert torch.equal(before[key], after[key]), f"{key} moved while frozen"
        else:
            assert not torch.equal(before[key], after[key]), f"{key} did not train"


def test_zero_grad_freeze_moves_frozen_weights_by_decay_and_momentum_alone(data_dir, base_ckpt, tmp_path):
    """freeze_mode "zero_grad" in the decay phase: main (16 steps) fills AdamW's moments; then each decay step
    zeroes the frozen gradients, so decoupled AdamW decays the weights and its moments keep moving them. The
    frozen weights in final must be what the AdamW formula gives from ckpt-16, in float64, over the 4 steps."""
    wd, lr, betas, eps = 0.1, 3e-3, (0.9, 0.98), 1e-6
    run_train(tmp_path, data_dir, f"--init_from={base_ckpt}", "--freeze_layers=0-1", "--freeze_phase=decay",
              "--freeze_mode=zero_grad", f"--weight_decay={wd}", "--max_ckpts=10")
    ckpt = torch.load(tmp_path / "ckpt-16" / "train_state.pt", weights_only=False)["optimizer"]
    before = load_file(tmp_path / "ckpt-16" / "model.safetensors")
    after = load_file(tmp_path / "final" / "model.safetensors")
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))
    named = list(model.named_parameters())  # the optimizer's parameter ids: its groups' order, matrices first
    order = [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]
    index = {name: i for i, name in enumerate(order)}
    decayed = {i for g in ckpt["param_groups"] if g["weight_decay"] > 0 for i in g["params"]}
    checked = 0
    for name, i in index.items():
        if not name.startswith(("model.layers.0.", "model.layers.1.")):
            continue
        state = ckpt["state"][i]
        p, m, v = (t.double() for t in (before[name], state["exp_avg"], state["exp_avg_sq"]))
        step = int(state["step"])
        for t in range(4):  # the decay's lr: 1-sqrt from lr to 0.1 lr over its 4 steps
            lr_t, step = lr * (0.1 + 0.9 * (1 - math.sqrt(t / 4))), step + 1
            p = p * (1 - lr_t * wd / lr) if i in decayed else p  # decoupled: relative to the peak lr
            m, v = betas[0] * m, betas[1] * v  # the gradient is 0
            p = p - lr_t / (1 - betas[0] ** step) * m / ((v / (1 - betas[1] ** step)).sqrt() + eps)
        moved = (after[name].double() - before[name].double()).abs().max().item()
        ulps = 16 * 2 ** -24 * before[name].abs().max().item()  # float32 rounding over the 4 steps, and a margin
        assert moved > 100 * ulps, f"{name} did not move by decay and momentum"
        assert torch.allclose(after[name].double(), p, rtol=0, atol=ulps), name
        checked += 1
    assert checked == sum(1 for k in before if k.startswith(("model.layers.0.", "model.layers.1.")))


def test_frozen_layers_compute_no_weight_gradient(data_dir):
    """While frozen, the layers' weights get no gradient at all (not one computed, then dropped); the layers
    below them and the embeddings still get theirs through the frozen layers."""
    meta = load_meta(data_dir)
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))
    c = Config(freeze_layers="1-2", freeze_phase="main")
    freeze, phases = Freeze(c, model, ["main", "decay"]), Schedule.from_config(c).phases
    batch = clm_batch(Loader(data_dir, "train", 64, 2, data_seed=1).next(), meta["eos_id"])
    assert freeze.enter(phases[0]) and not freeze.enter(phases[0])
    forward_backward(model, [batch], True, Process(0, 1, torch.device("cpu")), torch.autocast("cpu", enabled=False))
    frozen = {n for n, p in model.named_parameters() if n.startswith(("model.layers.1.", "model.layers.2."))}
    assert frozen and all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n not in frozen)
    assert freeze.enter(phases[1]) and all(p.requires_grad for p in model.parameters())  # the decay trains them


@pytest.mark.parametrize("freeze_mode", ["exact", "zero_grad"])
def test_resume_inside_a_frozen_phase_is_exact(data_dir, base_ckpt, tmp_path, freeze_mode):
    """Layers 0-1 frozen in main; the run resumes from ckpt-8, mid-phase: the frozen set is entered again on
    resume (no weight gradient for them, AdamW's state as saved), so every loss and the final weights are the
    uninterrupted run's, bit for bit."""
    args = [f"--init_from={base_ckpt}", "--freeze_layers=0-1", "--freeze_phase=main", f"--freeze_mode={freeze_mode}",
            "--weight_decay=0.1", "--max_ckpts=10"]
    run_train(tmp_path, data_dir, *args)
    whole, final = metrics(tmp_path), load_file(tmp_path / "final" / "model.safetensors")
    for later in [d for d in os.listdir(tmp_path) if d == "final" or d.startswith("ckpt-") and int(d[5:]) > 8]:
        shutil.rmtree(tmp_path / later)  # as if the run had died after writing ckpt-8
    r = run_train(tmp_path, data_dir, *args)
    assert "resuming at step 8" in r.stdout, r.stdout[-2000:]
    assert [(m["step"], m["loss"], m.get("val_mlm_loss")) for m in metrics(tmp_path)] == \
        [(m["step"], m["loss"], m.get("val_mlm_loss")) for m in whole]
    resumed = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


# -----------------------------------------------------------------------------
# 4. Resume after a real kill gives the same losses as an uninterrupted run


def test_resume_after_sigkill_is_exact(data_dir, base_ckpt, tmp_path):
    args = [f"--init_from={base_ckpt}", f"--tokens={60 * 8 * 64}", "--ckpt_interval=20", "--eval_interval=20"]
    run_train(tmp_path / "whole", data_dir, *args)
    out = tmp_path / "killed"
    cmd = train_cmd(out, data_dir, *args)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not os.path.exists(out / "ckpt-20" / "train_state.pt") and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(out / "final"), "the run finished before it could be killed"
    killed_at = max(m["step"] for m in metrics(out))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming at step" in r.stdout
    whole, resumed = metrics(tmp_path / "whole"), metrics(out)
    assert [(m["step"], m["loss"]) for m in whole] == [(m["step"], m["loss"]) for m in resumed]
    assert [m.get("val_mlm_loss") for m in whole] == [m.get("val_mlm_loss") for m in resumed]
    print(f"killed after step {killed_at}; resumed losses equal bit for bit over {len(whole)} logged steps")


# -----------------------------------------------------------------------------
# 5. torchrun with 2 processes (gloo) = one process with the same global batch


def test_torchrun_two_processes_equal_one(data_dir, base_ckpt, tmp_path):
    """Layers 0-1 frozen in the decay: DDP is rebuilt at the boundary to all-reduce only what trains."""
    args = [f"--init_from={base_ckpt}", "--attn_out_dropout=0.0", "--micro_batch_size=2", "--freeze_layers=0-1",
            "--freeze_phase=decay", "--max_ckpts=10"]
    run_train(tmp_path / "one", data_dir, *args)
    run_train(tmp_path / "two", data_dir, *args, nproc=2)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["step"] for m in one] == [m["step"] for m in two]
    worst = max(abs(a["loss"] - b["loss"]) for a, b in zip(one, two))
    worst_val = max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in ("val_mlm_loss", "val_clm_loss") if k in a)
    print(f"torchrun 2 vs 1 process: max |loss diff| {worst:.2e}, max |val loss diff| {worst_val:.2e}")
    assert worst <= 1e-5 and worst_val <= 1e-5
    before, after = (load_file(tmp_path / "two" / d / "model.safetensors") for d in ("ckpt-16", "final"))
    assert all(torch.equal(before[k], after[k]) == k.startswith(("model.layers.0.", "model.layers.1.")) for k in before)


def test_torchrun_with_one_process_runs_ddp_and_equals_python(data_dir, tmp_path):
    """Under torchrun a world of one runs what many do (the process group, DDP, every collective: NCCL's path on one
    GPU), and computes what plain python does, bit for bit."""
    run_train(tmp_path / "python", data_dir, "--decay_frac=0")
    cmd = [*launcher(1, torchrun=True), *train_cmd(tmp_path / "torchrun", data_dir, "--decay_frac=0")[1:]]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world 1 (gloo DDP), accumulation 2" in r.stdout
    assert [m["loss"] for m in metrics(tmp_path / "torchrun")] == [m["loss"] for m in metrics(tmp_path / "python")]


# -----------------------------------------------------------------------------
# 6. The final directory is a Hugging Face checkpoint


def test_final_loads_in_transformers(data_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_train(tmp_path, data_dir, "--run_phases=main", f"--tokens={4 * 8 * 64}")
    final = tmp_path / "final"
    hf, info = transformers.AutoModelForMaskedLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ours = ModernBertForMaskedLM.from_pretrained(final).eval()
    ids = Loader(data_dir, "val", 64, 3, data_seed=0).next()
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    with torch.no_grad():
        diff = (ours(ids, mask) - hf.eval()(input_ids=ids, attention_mask=mask).logits)[mask.bool()].abs().max()
    assert diff <= 1e-4
    assert (final / "tokenizer.json").is_file()  # the tokenizer travels with the checkpoint


# -----------------------------------------------------------------------------
# 7. Clear errors


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(SystemExit, match="unknown config key 'learning_rate'.*Valid keys: out_dir"):
        parse_config(["--learning_rate=1e-3"])
    (tmp_path / "c.py").write_text("lr = 1\nobjective = 'mlm'\nimport math\nbatch = 3\n")
    with pytest.raises(SystemExit, match="c.py: unknown config key 'batch'"):
        parse_config([str(tmp_path / "c.py")])
    (tmp_path / "c.py").write_text("lr = 1\ntokens = 10e9\n")
    c = parse_config([str(tmp_path / "c.py"), "--objective=mlm"])
    assert c.lr == 1.0 and isinstance(c.lr, float) and c.tokens == 10_000_000_000 and c.objective == "mlm"
    with pytest.raises(SystemExit, match="seq_len must be int"):
        parse_config(["--seq_len=abc"])


@pytest.mark.parametrize("phases, message", [
    ([{"name": "a", "objective": "clm", "tokens": 100, "lr": 3}], "must be a dict with name, objective and tokens"),
    ([{"name": "a", "objective": "mlm", "tokens": 100}], "phase 'a': mask_prob=0.0: choose it in"),
    ([{"name": "a", "objective": "clm", "tokens": 100, "mask_prob": 0.3}], "mask_prob is for mlm phases"),
    ([{"name": "a", "objective": "clm", "tokens": 100, "warmup_tokens": -5}], "a warmup of 0 or more"),
    ([{"name": "a", "objective": "mlm", "tokens": 9, "mask_prob": 0.2, "decay": True, "warmup_tokens": 3}], "no warmup"),
    ([{"name": "a", "objective": "clm", "tokens": 9}] * 2, "names must be unique"),
])
def test_a_phase_that_means_nothing_is_one_clear_line(phases, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_config([f"--phases={phases!r}"])
    with pytest.raises(SystemExit, match="run_phases='decay,main': write 'all' or consecutive phase names in order"):
        parse_config(["--run_phases=decay,main"])


def test_missing_data_and_vocab_mismatch_are_clear(data_dir, tmp_path):
    r = run_train(tmp_path / "a", str(tmp_path / "nowhere"), check=False)
    assert r.returncode != 0 and "no meta.json" in r.stderr and "python data.py --input" in r.stderr
    small = tmp_path / "small"
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=128, **TINY)).save_pretrained(small)
    r = run_train(tmp_path / "b", data_dir, f"--init_from={small}", check=False)
    assert r.returncode != 0 and "vocab mismatch" in r.stderr and "--tokenizer" in r.stderr


def test_every_config_parses_and_ablations_stack():
    configs = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))
    bases = [f for f in configs if f.startswith(("fr_", "en_"))]
    assert bases == ["en_base.py", "en_large.py", "fr_base.py", "fr_large.py"]
    for base in bases:
        for extra in [[]] + [[f] for f in configs if f not in bases and f not in ("demo.py", "study.py",
                                                                                  "study_base.py")]:
            c = parse_config([os.path.join(ROOT, "configs", f) for f in [base, *extra]])
            assert c.seq_len == 8192 and c.global_batch_size == 384 and c.lr == 2e-4 and c.data_seed == 42
            assert c.global_batch_size % (4 * c.micro_batch_size) == 0  # 4 GPUs
            assert extra == [] or c.out_dir != parse_config([os.path.join(ROOT, "configs", base)]).out_dir
    twin = parse_config([os.path.join(ROOT, "configs", f) for f in ("fr_base.py", "seed_twin.py")])
    mlm = parse_config([os.path.join(ROOT, "configs", f) for f in ("fr_base.py", "mlm_baseline.py")])
    assert (twin.objective, twin.seed, mlm.objective, mlm.seed) == ("mlm", 42, "mlm", 17)
    assert parse_config([os.path.join(ROOT, "configs", "demo.py")]).device == "cpu"
    study, base = (parse_config([os.path.join(ROOT, "configs", f) for f in files])  # demo.py --study's two stacks
                   for files in (["study.py"], ["study.py", "study_base.py"]))
    assert (study.init_from, base.init_from, base.objective, study.seq_len, base.seq_len) == (
        "scratch", "scratch", "mlm", 1024, 1024) and study.tokens < base.tokens
    ten, fifty = (parse_config([os.path.join(ROOT, "configs", f) for f in files])
                  for files in (["en_base.py"], ["en_base.py", "tokens_50b.py"]))
    assert (ten.tokens, fifty.tokens) == (10 ** 10, 5 * 10 ** 10)  # the English 10B and 50B runs share no folder
    assert ten.out_dir != fifty.out_dir and ten.data_dir != fifty.data_dir


# -----------------------------------------------------------------------------
# 8. Against an outside expectation: what each step of a real run trains on, at what lr, and what it logs.
# One in-process run of train.main through the real prefetch thread, three phases of 4 steps (CLM, MLM 40%
# with its own warmup, an MLM 15% decay), 2 micro batches of 4 x 64 tokens per step; the model's forward is
# wrapped to record what it receives and returns. Training calls run with gradients, evaluations under no_grad.

STEPS_OF_PHASE = [("clm", None)] * 4 + [("mlm", 0.4)] * 4 + [("mlm", 0.15)] * 4  # (objective, mask_prob) by step


@pytest.fixture(scope="module")
def three_phase_run(data_dir, base_ckpt, tmp_path_factory):
    import inspect
    import signal as signals
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import train

    out = tmp_path_factory.mktemp("three_phases")
    step_tokens = 8 * 64
    phases = [dict(name="clm", objective="clm", tokens=4 * step_tokens, warmup_tokens=2 * step_tokens),
              dict(name="mlm", objective="mlm", tokens=4 * step_tokens, mask_prob=0.4, warmup_tokens=3 * step_tokens),
              dict(name="decay", objective="mlm", tokens=4 * step_tokens, mask_prob=0.15, decay=True,
                   final_lr_frac=0.1)]
    calls, lrs, config = [], [], []
    forward = ModernBertForMaskedLM.forward
    signature = inspect.signature(forward)

    def recording_forward(self, *args, **kwargs):
        result = forward(self, *args, **kwargs)
        a = signature.bind(self, *args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        config.append(self.config)
        calls.append(dict(train=torch.is_grad_enabled(), causal=bool(a["causal"]),
                          tokens=a["input_ids"].detach().clone(), cu_seqlens=a["cu_seqlens"].clone(),
                          rows=a["rows"].clone(), targets=a["targets"].clone(), loss_sum=result.item(),
                          steps_before=sum(c["train"] for c in calls) // 2))
        return result

    handlers = {s: signals.getsignal(s) for s in (signals.SIGTERM, signals.SIGINT)}  # train.main sets its own
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: lrs.append([g["lr"] for g in opt.param_groups]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess runs (OMP_NUM_THREADS=1): tiny matmuls on 2 threads crawl
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ModernBertForMaskedLM, "forward", recording_forward)
            train.main([f"--data_dir={data_dir}", f"--out_dir={out}", f"--init_from={base_ckpt}", "--seq_len=64",
                        "--global_batch_size=8", "--micro_batch_size=4", f"--phases={phases!r}", "--lr=3e-3",
                        "--log_interval=3", "--eval_interval=100", "--eval_windows=16", "--ckpt_interval=100",
                        "--device=cpu", "--compile=False", "--peak_tflops=0.001"])
    finally:
        torch.set_num_threads(threads)
        hook.remove()
        for s, handler in handlers.items():
            signals.signal(s, handler)
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    special = {meta[k] for k in ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")}
    return dict(calls=calls, lrs=lrs, config=config[0], records=metrics(out), special=special, mask_id=meta["mask_id"])


def check_clm_batch(call, mask_id):
    """Causal, and a target for every position but the last of each sequence: its next token."""
    tokens, cu = call["tokens"], call["cu_seqlens"].long()
    last = set((cu[1:] - 1).tolist())
    assert call["causal"], "a CLM batch under the bidirectional mask"
    assert call["rows"].tolist() == [i for i in range(len(tokens)) if i not in last], "not every next token"
    assert torch.equal(call["targets"], tokens[call["rows"] + 1]) and not (tokens == mask_id).any()


def mlm_counts(call, special, mask_id):
    """(chosen rows, maskable tokens, chosen rows whose input is [MASK]) of a bidirectional MLM batch."""
    assert not call["causal"], "an MLM batch under the causal mask"
    original = call["tokens"].clone()
    original[call["rows"]] = call["targets"]  # the input elsewhere is the text itself
    is_special = torch.isin(original, torch.tensor(sorted(special)))
    assert not is_special[call["rows"]].any(), "a special token was masked"
    assert not (call["tokens"][~torch.isin(torch.arange(len(original)), call["rows"])] == mask_id).any()
    return len(call["rows"]), int((~is_special).sum()), int((call["tokens"][call["rows"]] == mask_id).sum())


def within(k, n, p, sds=4.5):
    return abs(k - n * p) <= sds * math.sqrt(n * p * (1 - p))


def test_every_step_trains_on_the_batch_its_phase_calls_for(three_phase_run):
    """At each of the 12 steps, across both phase boundaries, the two micro batches the model trains on are
    the phase's, read from the batches themselves: CLM (causal, every next token) for steps 0-3, MLM with
    40% of the maskable tokens chosen for steps 4-7 and 15% for steps 8-11 (bidirectional, specials never
    chosen, about 80% of the chosen inputs [MASK]); 4 windows of 64 tokens each."""
    run = three_phase_run
    training = [c for c in run["calls"] if c["train"]]
    assert len(training) == 2 * len(STEPS_OF_PHASE)
    chosen_masked = [0, 0]
    for step, (objective, mask_prob) in enumerate(STEPS_OF_PHASE):
        micro = training[2 * step:2 * step + 2]
        assert all(c["cu_seqlens"].tolist() == [0, 64, 128, 192, 256] for c in micro)
        if objective == "clm":
            for c in micro:
                check_clm_batch(c, run["mask_id"])
            continue
        k, n, masked = (sum(x) for x in zip(*(mlm_counts(c, run["special"], run["mask_id"]) for c in micro)))
        assert within(k, n, mask_prob), f"step {step}: {k} of {n} maskable tokens chosen, not about {mask_prob:.0%}"
        chosen_masked = [chosen_masked[0] + k, chosen_masked[1] + masked]
    assert within(chosen_masked[1], chosen_masked[0], 0.8), "not 80% of the chosen inputs are [MASK]"


def test_evaluations_measure_mlm_at_15_percent_and_clm(three_phase_run):
    """At the end of each phase (steps 4, 8, 12), an evaluation under no_grad: eval_windows (16) windows as MLM
    at 15% masking (bidirectional) and the same 16 as CLM (causal, every next token); each logged validation
    loss is the sum of its batches' cross-entropy sums over their target count."""
    run = three_phase_run
    evals = [c for c in run["calls"] if not c["train"]]
    assert sorted({c["steps_before"] for c in evals}) == [4, 8, 12]
    k = n = 0
    for after in (4, 8, 12):
        these = [c for c in evals if c["steps_before"] == after]
        mlm, clm = [c for c in these if not c["causal"]], [c for c in these if c["causal"]]
        assert sum(len(c["cu_seqlens"]) - 1 for c in mlm) == sum(len(c["cu_seqlens"]) - 1 for c in clm) == 16
        record = next(m for m in run["records"] if m["step"] == after)
        for key, calls in (("val_mlm_loss", mlm), ("val_clm_loss", clm)):
            want = sum(c["loss_sum"] for c in calls) / sum(len(c["targets"]) for c in calls)
            assert record[key] == pytest.approx(want, rel=1e-5), (after, key)
        for c in clm:
            check_clm_batch(c, run["mask_id"])
        for c in mlm:
            chosen, maskable, _ = mlm_counts(c, run["special"], run["mask_id"])
            k, n = k + chosen, n + maskable
    assert within(k, n, 0.15), f"validation MLM: {k} of {n} maskable tokens chosen, not about 15%"


def test_each_step_runs_at_its_phase_lr(three_phase_run):
    """The lr every parameter group has when the optimizer steps, against the phases' formulas written out: a
    2-step warmup to 3e-3 in the CLM phase, the MLM phase's own 3-step warmup from its first step, then the
    decay's 1-sqrt from 3e-3 to 3e-4 over its 4 steps."""
    lr = 3e-3
    expected = ([lr / 2, lr, lr, lr] + [lr / 3, 2 * lr / 3, lr, lr]
                + [lr * (0.1 + 0.9 * (1 - math.sqrt(t / 4))) for t in range(4)])
    got = three_phase_run["lrs"]
    assert len(got) == len(expected)
    for step, (groups, want) in enumerate(zip(got, expected)):
        assert all(g == pytest.approx(want, rel=1e-12) for g in groups), f"step {step}: lr {groups}, not {want}"


def test_logged_loss_is_the_mean_of_the_steps_since_the_last_record(three_phase_run):
    """log_interval 3, with an evaluation and a record at each phase end: records at steps 3, 4, 6, 8, 9, 12.
    Each step's loss is the sum of its micro batches' cross-entropy sums (what the model returned) over its
    target count; each record's loss is the mean of the step losses since the record before it, named by the
    phase of its last step."""
    run = three_phase_run
    training = [c for c in run["calls"] if c["train"]]
    step_loss = [sum(c["loss_sum"] for c in training[2 * s:2 * s + 2])
                 / sum(len(c["targets"]) for c in training[2 * s:2 * s + 2]) for s in range(12)]
    records = run["records"]
    assert [(m["step"], m["phase"], m["objective"]) for m in records] == [
        (3, "clm", "clm"), (4, "clm", "clm"), (6, "mlm", "mlm"), (8, "mlm", "mlm"), (9, "decay", "mlm"),
        (12, "decay", "mlm")]
    assert all(m["tokens"] == m["step"] * 8 * 64 for m in records)
    previous = 0
    for m in records:
        want = sum(step_loss[previous:m["step"]]) / (m["step"] - previous)
        assert m["loss"] == pytest.approx(want, rel=1e-5), f"record at step {m['step']}"
        previous = m["step"]
    assert all(("val_mlm_loss" in m) == (m["step"] in (4, 8, 12)) for m in records)


def test_logged_mfu_is_the_flops_of_the_steps_since_the_last_record(three_phase_run):
    """With a peak set (--peak_tflops 0.001: 1e9 FLOP/s on CPU), each record's MFU is the model FLOPs of the
    batches trained on since the record before it (counted from the recorded batches: their sequence lengths,
    mask and target rows) over the training time and the peak; the time is what tokens_per_s says it was."""
    run = three_phase_run
    training = [c for c in run["calls"] if c["train"]]
    flops = [training_flops(run["config"], c["cu_seqlens"].diff().tolist(), c["causal"], len(c["targets"]))
             for c in training]
    step_flops = [flops[2 * s] + flops[2 * s + 1] for s in range(12)]
    previous = 0
    for m in run["records"]:
        seconds = (m["step"] - previous) * 8 * 64 / m["tokens_per_s"]
        assert m["mfu"] == pytest.approx(sum(step_flops[previous:m["step"]]) / seconds / 1e9, rel=1e-9), m["step"]
        previous = m["step"]
