"""train.py on CPU with a tiny model: the one flag, the schedule and phases, freezing, exact resume, torchrun =
one process, Hugging Face export, clear errors, and what each step of a real run trains on."""

import contextlib
import io
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

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from data import Loader, clm_batch, load_meta, mlm_batch, prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM
from support import lock
from support.flops import training_flops
from support.processes import Process
from support.tokenizer import train_bpe
from train import Config, Freeze, Schedule, batch_loss, forward_backward, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2, local_attention=16)
SPECIAL = ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")
FROZEN = ("model.layers.0.", "model.layers.1.")


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
    """A port of its own for each torchrun, so that tests running side by side (pytest -n) never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(nproc, torchrun=False):
    if nproc == 1 and not torchrun:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


def train_cmd(out_dir, data_dir, *overrides, nproc=1, torchrun=False):
    """A tiny run: 16 main + 4 decay steps of 8 x 64 tokens, unless overridden."""
    args = [f"--data_dir={data_dir}", f"--out_dir={out_dir}", f"--model_config={TINY!r}", "--seq_len=64",
            "--global_batch_size=8", "--micro_batch_size=4", f"--tokens={16 * 8 * 64}", f"--warmup_tokens={4 * 8 * 64}",
            "--lr=3e-3", "--decay_frac=0.25", "--log_interval=1", "--eval_interval=8", "--eval_windows=16",
            "--ckpt_interval=8", "--device=cpu", *overrides]
    return launcher(nproc, torchrun) + [os.path.join(ROOT, "train.py"), *args]


def run_train(out_dir, data_dir, *overrides, check=True, env=None, nproc=1, torchrun=False):
    r = subprocess.run(train_cmd(out_dir, data_dir, *overrides, nproc=nproc, torchrun=torchrun), capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=ROOT)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def train_here(out_dir, data_dir, *overrides, check=True):
    """run_train in this process (no interpreter and imports to start): train.main on train_cmd's arguments, then
    what a process's exit undoes (its signal handlers, its hold on out_dir) -> its returncode, stdout and stderr."""
    import train

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}  # train.main sets its own
    holds, out, err, code = set(lock.held), io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            train.main(train_cmd(out_dir, data_dir, *overrides)[2:])  # [2:]: train.py's arguments
    except SystemExit as e:  # as the interpreter exits: a message goes to stderr, with status 1
        if isinstance(e.code, str):
            print(e.code, file=err)
        code = 1 if isinstance(e.code, str) else e.code or 0
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        for key in set(lock.held) - holds:  # unlocked, so that the next run takes it (and checks it) anew
            hold = lock.held.pop(key)
            with hold.writing:  # its heartbeat thread writes on, to /dev/null
                fd, hold.fd, hold.failed = hold.fd, os.open(os.devnull, os.O_WRONLY), True
            os.close(fd)
    r = subprocess.CompletedProcess([], code, out.getvalue(), err.getvalue())
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


TIMINGS = ("tokens_per_s", "mfu", "eval_s", "checkpoint_s", "compile_s")  # a record's fields that time the machine


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def config(*names, argv=()):
    """The Config of files in configs/, stacked, then argv."""
    return parse_config([os.path.join(ROOT, "configs", n) for n in names] + list(argv))


def tiny_model():
    torch.manual_seed(0)
    return ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))


def test_losses_equal_reference_cross_entropy(data_dir):
    """MLM: two micro batches with different target counts give the loss and gradients of one cross-entropy over all
    their targets: each sum is divided by the global batch's target count, not by its own. CLM: the next token's
    cross-entropy under the causal mask."""
    meta = load_meta(data_dir)
    model = tiny_model().eval()  # no dropout
    windows = Loader(data_dir, "train", 64, 2, data_seed=1).next()  # (2, 64): one window per micro batch
    batches = [mlm_batch(windows[i:i + 1], p, {k: meta[k] for k in SPECIAL}, meta["vocab_size"], seed=[17, 0, i])
               for i, p in enumerate([0.1, 0.5])]
    counts = [b.targets.numel() for b in batches]
    assert counts[0] * 2 < counts[1]  # the micro batches weigh differently
    loss = forward_backward(model, batches, False, Process(0, 1, torch.device("cpu")),
                            torch.autocast("cpu", enabled=False))
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(b.tokens.view(1, 64)).view(64, 320)[b.rows] for b in batches])  # (N, V)
    ref = F.cross_entropy(logits.double(), torch.cat([b.targets for b in batches]))
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    for name, p in model.named_parameters():
        assert torch.allclose(ours[name], p.grad, rtol=1e-4, atol=1e-7), name
    with torch.no_grad():
        clm = clm_batch(windows, meta["eos_id"])
        ours = batch_loss(model, clm, causal=True) / clm.targets.numel()
        logits = model(windows, causal=True)  # padded entry point, (2, 64, V)
        ref = F.cross_entropy(logits[:, :-1].reshape(-1, 320), windows[:, 1:].reshape(-1))
    assert abs(ours.item() - ref.item()) < 1e-5


# Against an outside expectation: what each step of a real run trains on, at what lr, and what it logs. One
# in-process run of train.main through the real prefetch thread, three phases of 4 steps (CLM, MLM 40% with its own
# warmup, an MLM 15% decay), 2 micro batches of 4 x 64 tokens per step, a log every 3 steps, an evaluation every 5;
# the model's forward is wrapped to record what it receives and returns. Training calls run with gradients,
# evaluations under no_grad.

STEPS_OF_PHASE = [("clm", None)] * 4 + [("mlm", 0.4)] * 4 + [("mlm", 0.15)] * 4  # (objective, mask_prob) by step
EVALUATED = [4, 5, 8, 10, 12]  # the steps after which the run evaluates


@pytest.fixture(scope="module")
def three_phase_run(data_dir, base_ckpt, tmp_path_factory):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    out, step_tokens = tmp_path_factory.mktemp("three_phases"), 8 * 64
    phases = [dict(name="clm", objective="clm", tokens=4 * step_tokens, warmup_tokens=2 * step_tokens),
              dict(name="mlm", objective="mlm", tokens=4 * step_tokens, mask_prob=0.4, warmup_tokens=3 * step_tokens),
              dict(name="decay", objective="mlm", tokens=4 * step_tokens, mask_prob=0.15, decay=True,
                   final_lr_frac=0.1)]
    calls, lrs, config = [], [], []
    forward = ModernBertForMaskedLM.forward

    def recording_forward(self, input_ids, attention_mask=None, causal=False, **kw):
        result = forward(self, input_ids, attention_mask, causal, **kw)
        config.append(self.config)
        calls.append(dict(train=torch.is_grad_enabled(), causal=bool(causal), tokens=input_ids.detach().clone(),
                          cu_seqlens=kw["cu_seqlens"].clone(), rows=kw["rows"].clone(), targets=kw["targets"].clone(),
                          loss_sum=result.item(), steps_before=sum(c["train"] for c in calls) // 2))
        return result

    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: lrs.append([g["lr"] for g in opt.param_groups]))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ModernBertForMaskedLM, "forward", recording_forward)
            stdout = train_here(out, data_dir, f"--init_from={base_ckpt}", f"--phases={phases!r}",
                                "--log_interval=3", "--eval_interval=5", "--ckpt_interval=100", "--compile=False",
                                "--peak_tflops=0.001").stdout
    finally:
        hook.remove()
    meta = load_meta(data_dir)
    training = [c for c in calls if c["train"]]
    return dict(calls=calls, training=training, lrs=lrs, config=config[0], records=metrics(out), out=out,
                stdout=stdout, special={meta[k] for k in SPECIAL}, mask_id=meta["mask_id"])


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


def test_every_step_trains_on_the_batch_and_at_the_lr_its_phase_calls_for(three_phase_run):
    """Across both phase boundaries, each step's two micro batches are its phase's, read from the batches: CLM for
    steps 0-3, MLM choosing 40% of the maskable tokens for steps 4-7 and 15% for 8-11, about 80% of them [MASK].
    The lr: a 2-step warmup to 3e-3 in CLM, the MLM phase's own 3-step warmup, then the decay's 1-sqrt to 3e-4."""
    run, chosen, masked, lr = three_phase_run, 0, 0, 3e-3
    expected = ([lr / 2, lr, lr, lr] + [lr / 3, 2 * lr / 3, lr, lr]
                + [lr * (0.1 + 0.9 * (1 - math.sqrt(t / 4))) for t in range(4)])
    assert len(run["lrs"]) == len(expected)
    for step, (groups, want) in enumerate(zip(run["lrs"], expected)):
        assert all(g == pytest.approx(want, rel=1e-12) for g in groups), f"step {step}: lr {groups}, not {want}"
    assert len(run["training"]) == 2 * len(STEPS_OF_PHASE)
    for step, (objective, mask_prob) in enumerate(STEPS_OF_PHASE):
        micro = run["training"][2 * step:2 * step + 2]
        assert all(c["cu_seqlens"].tolist() == [0, 64, 128, 192, 256] for c in micro)
        if objective == "clm":
            for c in micro:
                check_clm_batch(c, run["mask_id"])
            continue
        k, n, m = (sum(x) for x in zip(*(mlm_counts(c, run["special"], run["mask_id"]) for c in micro)))
        assert within(k, n, mask_prob), f"step {step}: {k} of {n} maskable tokens chosen, not about {mask_prob:.0%}"
        chosen, masked = chosen + k, masked + m
    assert within(masked, chosen, 0.8), "not 80% of the chosen inputs are [MASK]"


def test_evaluations_measure_mlm_at_15_percent_and_clm(three_phase_run):
    """Every eval_interval (5) steps and at each phase end (steps 4, 8, 12), not every log_interval, under no_grad:
    the 16 eval_windows as MLM at 15% and as CLM; each logged validation loss is its batches' cross-entropy sums over
    their target count."""
    run = three_phase_run
    evals = [c for c in run["calls"] if not c["train"]]
    assert sorted({c["steps_before"] for c in evals}) == EVALUATED
    k = n = 0
    for after in EVALUATED:
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


def test_logged_loss_and_mfu_are_of_the_steps_since_the_last_record(three_phase_run):
    """log_interval 3 and a record with each evaluation. A step's loss is its micro batches' cross-entropy sums (what
    the model returned) over its target count; a record's, the mean of the steps' since the record before it. Its MFU
    (--peak_tflops 0.001: 1e9 FLOP/s) is the FLOPs of those steps' batches over the time tokens_per_s says. A
    record also says the seconds its tokens/s leaves out: its evaluation, the checkpoints written since the record
    before (ckpt-4 after step 4, ckpt-8 after 8); the end line counts them all, ckpt-12 and final included. One
    optimizer state across the phases: Adam's step count is never reset."""
    run, training = three_phase_run, three_phase_run["training"]
    step_loss = [sum(c["loss_sum"] for c in training[2 * s:2 * s + 2])
                 / sum(len(c["targets"]) for c in training[2 * s:2 * s + 2]) for s in range(12)]
    flops = [training_flops(run["config"], c["cu_seqlens"].diff().tolist(), c["causal"], len(c["targets"]))
             for c in training]
    records = run["records"]
    assert [(m["step"], m["phase"], m["objective"]) for m in records] == [
        (3, "clm", "clm"), (4, "clm", "clm"), (5, "mlm", "mlm"), (6, "mlm", "mlm"), (8, "mlm", "mlm"),
        (9, "decay", "mlm"), (10, "decay", "mlm"), (12, "decay", "mlm")]
    assert all(m["tokens"] == m["step"] * 8 * 64 for m in records)
    previous = 0
    for m in records:
        want = sum(step_loss[previous:m["step"]]) / (m["step"] - previous)
        assert m["loss"] == pytest.approx(want, rel=1e-5), f"record at step {m['step']}"
        seconds = (m["step"] - previous) * 8 * 64 / m["tokens_per_s"]
        assert m["mfu"] == pytest.approx(sum(flops[2 * previous:2 * m["step"]]) / seconds / 1e9, rel=1e-9), m["step"]
        previous = m["step"]
    assert [m["step"] for m in records if "val_mlm_loss" in m and "val_clm_loss" in m] == EVALUATED
    assert [m["step"] for m in records if m.get("eval_s", 0) > 0] == EVALUATED
    assert [m["step"] for m in records if m.get("checkpoint_s", 0) > 0] == [5, 9]
    stdout = run["stdout"]
    assert "outside the steps: 5 evaluations in " in stdout and ", 4 checkpoints in " in stdout, stdout[-500:]
    state = torch.load(run["out"] / "final" / "train_state.pt", weights_only=False)["optimizer"]["state"]
    assert {int(v["step"]) for v in state.values()} == {12}


@pytest.mark.parametrize("world", [1, 2])
def test_skip_stands_where_an_uninterrupted_run_stands(data_dir, world):
    """After Loader.skip(N tokens) fresh loaders on each rank give what a loader that read N tokens gives next."""
    whole = Loader(data_dir, "train", 64, 8, 42)
    for _ in range(5):
        whole.next()
    ahead = [whole.next() for _ in range(3)]  # (8, 64) each: steps 6-8 of the uninterrupted run
    parts = [Loader(data_dir, "train", 64, 8 // world, 42, rank, world) for rank in range(world)]
    assert [p.skip(5 * 8 * 64 + 63) for p in parts] == [5 * 8 * 64] * world  # whole windows only
    resumed = [torch.cat([p.next() for p in parts]) for _ in range(3)]  # the ranks' micro batches, in rank order
    assert all(torch.equal(a, b) for a, b in zip(ahead, resumed))
    fresh = Loader(data_dir, "train", 64, 8, 42).next()
    assert not torch.equal(fresh, ahead[0])  # the replay that skip avoids would differ


def test_decay_from_weights_without_train_state_warns_and_skips(data_dir, base_ckpt, tmp_path):
    """The decay alone from a Hugging Face directory: a warning naming --skip_tokens with the uninterrupted run's
    position (16 steps x 8 x 64 tokens); with it, the loader starts there."""
    r = train_here(tmp_path / "a", data_dir, f"--init_from={base_ckpt}", "--run_phases=decay")
    assert "the data position restarts" in r.stderr and "--skip_tokens=8192 " in r.stderr
    r = train_here(tmp_path / "b", data_dir, f"--init_from={base_ckpt}", "--run_phases=decay", "--skip_tokens=8192")
    assert "restarts" not in r.stderr and "starting 8,192 tokens into the stream (128 windows" in r.stdout
    loader = torch.load(tmp_path / "b" / "final" / "train_state.pt", weights_only=False)["loader"]
    assert loader["consumed"] == 128 + 4 * 8  # skipped, then the 4 decay steps of 8 windows


def test_frozen_layers_compute_no_weight_gradient(data_dir):
    """Not one computed, then dropped; the layers below them and the embeddings still get theirs."""
    meta = load_meta(data_dir)
    model = tiny_model()
    c = Config(freeze_layers="1-2", freeze_phase="main")
    freeze, phases = Freeze(c, model, ["main", "decay"]), Schedule(c).phases
    batch = clm_batch(Loader(data_dir, "train", 64, 2, data_seed=1).next(), meta["eos_id"])
    assert freeze.enter(phases[0]) and not freeze.enter(phases[0])
    forward_backward(model, [batch], True, Process(0, 1, torch.device("cpu")), torch.autocast("cpu", enabled=False))
    frozen = {n for n, p in model.named_parameters() if n.startswith(("model.layers.1.", "model.layers.2."))}
    assert frozen and all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n not in frozen)
    assert freeze.enter(phases[1]) and all(p.requires_grad for p in model.parameters())  # the decay trains them


@pytest.mark.parametrize("freeze_mode", ["exact", "zero_grad"])
def test_resume_inside_a_frozen_phase_is_exact(data_dir, base_ckpt, tmp_path, freeze_mode):
    """Layers 0-1 frozen in the decay (steps 9-12). exact: bit-identical, everything else trains. zero_grad: AdamW
    decays their matrices (decoupled: wd * lr_t / lr, not torch's lr_t * wd; norm weights not at all) and its moments
    (filled by main) move them, as its formula in float64 says. A resume from ckpt-10 enters the frozen set again:
    every loss and the final weights are the uninterrupted run's."""
    wd, lr, (b1, b2), eps = 0.1, 3e-3, (0.9, 0.98), 1e-6
    args = [f"--init_from={base_ckpt}", "--freeze_layers=0-1", "--freeze_phase=decay", f"--freeze_mode={freeze_mode}",
            f"--weight_decay={wd}", f"--tokens={8 * 8 * 64}", "--decay_frac=0.5", "--ckpt_interval=5"]  # 8 + 4 steps
    train_here(tmp_path, data_dir, *args)
    whole = metrics(tmp_path)
    before, final = (load_file(tmp_path / d / "model.safetensors") for d in ("ckpt-8", "final"))
    if freeze_mode == "exact":
        assert all(torch.equal(before[k], final[k]) == k.startswith(FROZEN) for k in before)
    else:
        optimizer = torch.load(tmp_path / "ckpt-8" / "train_state.pt", weights_only=False)["optimizer"]
        named = list(tiny_model().named_parameters())  # the optimizer's ids: its groups' order, matrices first
        order = [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]
        frozen = [(i, name) for i, name in enumerate(order) if name.startswith(FROZEN)]
        assert len(frozen) == sum(k.startswith(FROZEN) for k in before)
        for i, name in frozen:
            state = optimizer["state"][i]
            p, m, v = (t.double() for t in (before[name], state["exp_avg"], state["exp_avg_sq"]))
            step = int(state["step"])
            for t in range(4):  # the decay's lr: 1-sqrt from lr to 0.1 lr over its 4 steps; the gradient is 0
                lr_t, step, m, v = lr * (0.1 + 0.9 * (1 - math.sqrt(t / 4))), step + 1, b1 * m, b2 * v
                p = p * (1 - lr_t * wd / lr) if p.ndim >= 2 else p  # matrices only; decoupled: relative to the peak lr
                p = p - lr_t / (1 - b1 ** step) * m / ((v / (1 - b2 ** step)).sqrt() + eps)
            moved = (final[name].double() - before[name].double()).abs().max().item()
            ulps = 16 * 2 ** -24 * before[name].abs().max().item()  # float32 rounding over 4 steps, and a margin
            assert moved > 100 * ulps, f"{name} did not move by decay and momentum"
            assert torch.allclose(final[name].double(), p, rtol=0, atol=ulps), name
    for later in ("ckpt-12", "final"):
        shutil.rmtree(tmp_path / later)  # as if the run had died after writing ckpt-10
    r = train_here(tmp_path, data_dir, *args)
    assert "resuming at step 10" in r.stdout, r.stdout[-2000:]
    keys = ("step", "loss", "val_mlm_loss")
    assert [[m.get(k) for k in keys] for m in metrics(tmp_path)] == [[m.get(k) for k in keys] for m in whole]
    resumed = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_torchrun_one_process_is_python_and_two_equal_one(data_dir, base_ckpt, tmp_path):
    """A world of one runs what many do (the process group, DDP, every collective: NCCL's path on one GPU) and
    computes what python does, bit for bit; two processes (gloo) the same to rounding. Layers 0-1 frozen in the
    decay: DDP is rebuilt at the boundary to all-reduce only what trains."""
    args = [f"--init_from={base_ckpt}", "--attn_out_dropout=0.0", "--micro_batch_size=2", "--freeze_layers=0-1",
            "--freeze_phase=decay", f"--tokens={8 * 8 * 64}"]  # 8 + 2 steps
    train_here(tmp_path / "one", data_dir, *args)
    r = run_train(tmp_path / "torchrun", data_dir, *args, torchrun=True)
    assert "world 1 (gloo DDP), accumulation 4" in r.stdout, r.stdout[-3000:]
    one = metrics(tmp_path / "one")
    assert [m["loss"] for m in metrics(tmp_path / "torchrun")] == [m["loss"] for m in one]
    run_train(tmp_path / "two", data_dir, *args, nproc=2)
    two = metrics(tmp_path / "two")
    assert [m["step"] for m in one] == [m["step"] for m in two]
    keys = ("loss", "val_mlm_loss", "val_clm_loss")
    assert max(abs(a[k] - b[k]) for a, b in zip(one, two) for k in keys if k in a) <= 1e-5
    before, after = (load_file(tmp_path / "two" / d / "model.safetensors") for d in ("ckpt-8", "final"))
    assert all(torch.equal(before[k], after[k]) == k.startswith(FROZEN) for k in before)


def test_final_loads_in_transformers(data_dir, three_phase_run):
    transformers = pytest.importorskip("transformers")
    final = three_phase_run["out"] / "final"
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


def test_a_config_file_sets_known_keys_of_their_type(tmp_path):
    """(An unknown key or a value of another type on the command line: test_mistakes.)"""
    (tmp_path / "c.py").write_text("lr = 1\nobjective = 'mlm'\nimport math\nbatch = 3\n")
    with pytest.raises(SystemExit, match="c.py: unknown config key 'batch'"):
        parse_config([str(tmp_path / "c.py")])
    (tmp_path / "c.py").write_text("lr = 1\ntokens = 10e9\n")
    c = parse_config([str(tmp_path / "c.py"), "--objective=mlm"])
    assert c.lr == 1.0 and isinstance(c.lr, float) and c.tokens == 10_000_000_000 and c.objective == "mlm"


@pytest.mark.parametrize("phases, message", [
    ([{"name": "a", "objective": "clm", "tokens": 100, "lr": 3}], "must be a dict with name, objective and tokens"),
    ([{"name": "a", "objective": "mlm", "tokens": 100}], "phase 'a': mask_prob=0.0: choose it in"),
    ([{"name": "a", "objective": "clm", "tokens": 100, "mask_prob": 0.3}], "mask_prob is for mlm phases"),
    ([{"name": "a", "objective": "clm", "tokens": 100, "warmup_tokens": -5}], "a warmup of 0 or more"),
    ([{"name": "a", "objective": "mlm", "tokens": 9, "mask_prob": 0.2, "decay": True, "warmup_tokens": 3}],
     "no warmup"),
    ([{"name": "a", "objective": "clm", "tokens": 9}] * 2, "names must be unique"),
])
def test_a_phase_that_means_nothing_is_one_clear_line(phases, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_config([f"--phases={phases!r}"])
    with pytest.raises(SystemExit, match="run_phases='decay,main': write 'all' or consecutive phase names in order"):
        parse_config(["--run_phases=decay,main"])


def test_a_vocab_mismatch_is_clear(data_dir, tmp_path):
    import train

    small = tmp_path / "small"
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=128, **TINY)).save_pretrained(small)
    with pytest.raises(SystemExit, match="^vocab mismatch: .* --tokenizer"):  # at start-up, before any work
        train.main(train_cmd(tmp_path / "b", data_dir, f"--init_from={small}")[2:])
    assert not (tmp_path / "b").exists()


def test_every_config_parses_and_ablations_stack():
    configs = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))
    bases = [f for f in configs if f.startswith(("fr_", "en_"))]
    assert bases == ["en_base.py", "en_large.py", "fr_base.py", "fr_large.py"]
    for base in bases:
        for extra in [[]] + [[f] for f in configs if f not in bases + ["demo.py", "study.py", "study_base.py"]]:
            c = config(base, *extra)
            assert c.seq_len == 8192 and c.global_batch_size == 384 and c.lr == 2e-4 and c.data_seed == 42
            assert c.global_batch_size % (4 * c.micro_batch_size) == 0  # 4 GPUs
            assert extra == [] or c.out_dir != config(base).out_dir
    twin, mlm = config("fr_base.py", "seed_twin.py"), config("fr_base.py", "mlm_baseline.py")
    assert (twin.objective, twin.seed, mlm.objective, mlm.seed) == ("mlm", 42, "mlm", 17)
    assert config("demo.py").device == "cpu"
    # the study's two stacks (results/h200-2026-11-28)
    study, base = config("study.py"), config("study.py", "study_base.py")
    assert (study.init_from, base.init_from, base.objective, study.seq_len, base.seq_len) == (
        "scratch", "scratch", "mlm", 1024, 1024) and study.tokens < base.tokens
    ten, fifty = config("en_base.py"), config("en_base.py", "tokens_50b.py")
    assert (ten.tokens, fifty.tokens) == (10 ** 10, 5 * 10 ** 10)  # the English 10B and 50B runs share no folder
    assert ten.out_dir != fifty.out_dir and ten.data_dir != fifty.data_dir
