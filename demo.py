"""
The whole study of the paper, small, on CPU, with no download: one command.

    python demo.py                       # 10-15 minutes on 2 free CPU cores -> out/demo/report.md
    python demo.py --domain ../shared/data/biomed_sentences.txt --task ../shared/data/ncbi_disease \\
                   --out out/biomed      # a small biomedical replication
    python demo.py --base path/to/ModernBERT-base --domain corpus.jsonl --task my_task/
    python demo.py --study ../shared/data    # the study on real text, sized for one GPU and 8.25 minutes (--minutes)

Steps, each a command a user could type (printed as it runs):
  1. corpora: general and domain text (built-in: docstrings of the standard library, and of PyTorch and NumPy,
     installed with this project), held-out domain texts for CKA, and a downstream task (built-in: which
     subpackage a PyTorch/NumPy docstring comes from);
  2. data.py: a byte-level BPE trained on the general text, token shards;
  3. train.py: a tiny ModernBERT pretrained with MLM on the general text (the stand-in for "a pretrained
     ModernBERT"; skipped with --base);
  4. train.py from that base on the domain text: the CLM-detour arm, the MLM arm and an MLM seed twin, each
     followed by the MLM decay, with identical budgets;
  5. cka.py: the pair (detour vs MLM) and the control (MLM vs its seed twin), at the end and over training (the
     checkpoints each arm kept every 100 steps: keep_every in configs/demo.py);
  6. eval.py: fine-tuning of both arms on the task over 3 seeds;
  7. report.md with the tables, loss.png, divergence.png and trajectory.png.
With --study the same steps run on real text (the last section below): a Gutenberg base, biomedical arms with 3
seeds each side by side, three real tasks, and the detour's difference with an interval over both seed levels.
"""

import argparse
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np

from support.config import load_file
from support.files import read_json
from support import metrics
from support.suite import UPSTREAM, nested_delta, pct, run_file

ROOT = os.path.dirname(os.path.abspath(__file__))

# Sizes. "full" is the demo; "quick" is the test's: every step, tiny, on the first 2,000 docstrings of each
# corpus, with as many held-out texts as the README's cka.py commands draw. train: train.py overrides.
SCALES = {
    "full": dict(docs=None, base_tokens=1_200_000, arm_tokens=600_000, val_docs=200, heldout=300, cka_n=200,
                 cka_len=256, task_per_class=150, eval_epochs=4, eval_lr=5e-4, eval_seeds="42,43,44", eval_max_len=128,
                 train=[]),
    "quick": dict(docs=2000, base_tokens=20_000, arm_tokens=10_000, val_docs=200, heldout=200, cka_n=16, cka_len=256,
                  task_per_class=12, eval_epochs=1, eval_lr=5e-4, eval_seeds="42,43", eval_max_len=32,
                  train=["--eval_windows=8", "--keep_every=4"]),
}
# name -> train.py overrides on top of configs/demo.py, identical budgets; mlm_twin: the seed-noise control
ARMS = {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"], "mlm_twin": ["--objective=mlm", "--seed=42"]}


def run(logs, steps, parallel=1):
    """Run steps (log name, [script, args]) as a user would, `parallel` at a time (None: all): each command echoed, its
    output to logs/NAME.log, the latest line of the oldest one running to the console (in place on a terminal, every
    30 s on a pipe); side by side, they share the CPUs unless OMP_NUM_THREADS says otherwise. -> each one's seconds"""
    parallel = max(1, min(len(steps), parallel or len(steps)))
    here = lambda text: text.replace(ROOT + os.sep, "")  # noqa: E731  (paths from the repo root, where it runs)
    tty, width = sys.stdout.isatty(), shutil.get_terminal_size().columns - 1  # a wrapped line is not rewritten
    clear, share = "\r\033[K" if tty else "", str(max(1, (os.cpu_count() or 1) // parallel))
    env = {**({"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share} if parallel > 1 else {}),
           **os.environ, "PYTHONUNBUFFERED": "1"}  # unbuffered: each line reaches the log when the child prints it
    waiting, running, took, shown = list(enumerate(steps)), {}, [0.0] * len(steps), time.time()
    while waiting or running:
        while waiting and len(running) < parallel:
            k, (name, cmd) = waiting.pop(0)
            print(clear + "$ " + here(" ".join(cmd)))
            with open(log := os.path.join(logs, f"{name}.log"), "w") as f:
                running[k] = (subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                               env=env), log, time.time())
        time.sleep(0.2)
        for k in [k for k, (p, _, _) in running.items() if p.poll() is not None]:
            p, log, t0 = running.pop(k)
            took[k] = time.time() - t0
            print(f"{clear}  {'done' if p.returncode == 0 else 'failed'} in {took[k]:.0f}s, log: {here(log)}")
            if p.returncode != 0:
                for q, _, _ in running.values():  # a train.py checkpoints on SIGTERM: a rerun resumes it
                    q.terminate()
                raise SystemExit(f"step failed (exit {p.returncode}); the end of {log}:\n{open(log).read()[-3000:]}")
        if running and (tty or time.time() - shown >= 30):
            p, log, t0 = running[min(running)]
            with open(log, "rb") as f:  # its latest line: tqdm rewrites its bar with \r
                f.seek(max(0, os.path.getsize(log) - 2000))
                lines = [x.strip() for x in f.read().decode(errors="replace").replace("\r", "\n").split("\n")]
            status = f"  {time.time() - t0:.0f}s  " + next((x for x in reversed(lines) if x), "")
            print("\r" + status[:width] + "\033[K" if tty else status, end="" if tty else "\n", flush=True)
            shown = time.time()
    return took


def prepare_step(out, s, name, text, tokenizer):  # data.py: the token shards of text/TEXT.jsonl in data/NAME
    return (f"prepare_{name}", ["data.py", "--input", os.path.join(out, "text", f"{text}.jsonl"), "--tokenizer",
                                tokenizer, "--out", os.path.join(out, "data", name), "--val_docs", str(s["val_docs"])])


def cka_step(out, s, name, *what):  # cka.py on the held-out texts, its log and --out named `name`
    return (name, ["cka.py", "--texts", os.path.join(out, "text", "heldout.jsonl"), "--n", str(s["cka_n"]),
                   "--max_len", str(s["cka_len"]), *what, "--out", os.path.join(out, name)])


def build_corpora(out, s, general, domain):
    """text/general.jsonl (unless general is None: a base is given), text/heldout.jsonl and text/domain.jsonl: the
    domain's texts, each once, shuffled (seed 0), s["heldout"] of them held out for CKA, the rest to pretrain on.
    general and domain are text files, or "builtin": the docstrings, the domain's with its task (task/*.jsonl, whose
    texts stay out of both): docstring -> its subpackage (torch.nn, numpy.linalg, ...), split 60/20/20."""
    from data import demo_documents, read_documents

    def docs(source, part):  # (module, text) pairs, the first s["docs"]
        return islice(demo_documents(part) if source == "builtin" else ((None, d) for d in read_documents(source)),
                      s["docs"])

    def jsonl(rows, *parts):
        os.makedirs(os.path.join(out, *parts[:-1]), exist_ok=True)
        Path(out, *parts).write_text("".join(json.dumps(row) + "\n" for row in rows))
    rng, task = random.Random(0), {"train": [], "validation": [], "test": []}
    if general:
        jsonl(({"text": d} for _, d in docs(general, "general")), "text", "general.jsonl")
    labelled = list(docs(domain, "domain"))
    if domain == "builtin":
        packages = [(".".join(m.split(".")[:2]) if m.count(".") > 1 else None, d) for m, d in labelled]
        counts = Counter(c for c, _ in packages if c)
        for c in [c for c, n in counts.most_common(8) if n >= 5]:  # 60/20/20 of 5 leaves each split one
            texts = [d for p, d in packages if p == c]
            picked = rng.sample(texts, min(s["task_per_class"], len(texts)))
            a, b = int(0.6 * len(picked)), int(0.8 * len(picked))
            for split, part in zip(task, (picked[:a], picked[a:b], picked[b:])):
                task[split] += [{"text": d, "label": c} for d in part]
        for split, rows in task.items():
            jsonl(rows, "task", f"{split}.jsonl")
    seen = {row["text"] for rows in task.values() for row in rows}
    domain = [d for d in dict.fromkeys(d for _, d in labelled) if d not in seen]  # task texts stay unseen
    rng.shuffle(domain)
    jsonl(({"text": d} for d in domain[:s["heldout"]]), "text", "heldout.jsonl")
    jsonl(({"text": d} for d in domain[s["heldout"]:]), "text", "domain.jsonl")


def figures(out, arms, main_tokens):
    """loss.png of the arms' logs ({name: records}); CKA's divergence.png and trajectory.png copied beside it."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    for sub, png in (("cka", "divergence.png"), ("trajectory", "trajectory.png")):
        shutil.copyfile(os.path.join(out, sub, png), os.path.join(out, png))
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4))
    kilo = lambda records: [r["tokens"] / 1e3 for r in records]  # noqa: E731
    for (name, records), color in zip(arms.items(), ("C3", "C0", "C2", "C1", "C4", "C5", "C6", "C7")):  # tokens from 0
        val = [r for r in records if "val_mlm_loss" in r]
        left.plot(kilo(records), [r["loss"] for r in records], color=color, label=name)
        mid.plot(kilo(val), [r["val_mlm_loss"] for r in val], "o-", ms=3, color=color, label=name)
        # The decay alone: validation from the end of phase 1 on, and the training loss, there too MLM (15%)
        decay, val = [r for r in records if r["phase"] == "decay"], [r for r in val if r["tokens"] >= main_tokens]
        right.plot(kilo(decay), [r["loss"] for r in decay], color=color, alpha=0.4, lw=1)
        right.plot(kilo(val), [r["val_mlm_loss"] for r in val], "o-", color=color, label=f"{name} (validation)")
    for ax, title in ((left, "training loss (phase 1: the arm's objective; decay: MLM 15%)"),
                      (mid, "validation MLM loss (15% masking, fixed seed)"),
                      (right, "the decay: MLM loss, validation (points) and training (line)")):
        ax.axvline(main_tokens / 1e3, color="k", ls="--", lw=1, label="start of the decay")
        ax.set_xlabel("tokens seen in continued pretraining (thousands)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    left.set_ylabel("loss")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)


def cka_rows(regions):
    """CKA's table by layer region: the divergence of the pair and of the control, and their ratio."""
    return ["| layers | pair (%) | control (%) | ratio |", "|---|---|---|---|"] + [
        f"| {r['layers']} | {pct(r['pair_divergence'])} | {pct(r['control_divergence'])} | "
        + ("n/a" if r["ratio"] is None else f"{r['ratio']['mean']:.2f}x") + " |" for r in regions]


def trajectory_section(out, s):
    """The trajectory's table (divergence by region at every kept step), its figure, and what it says."""
    traj = read_json(os.path.join(out, "trajectory", "trajectory.json"))
    points, low = traj["steps"], traj["settings"]["regions"][0]
    apart = lambda p: 100 * p["pair"]["regions"][0]["mean"]  # noqa: E731  (the low region)
    first, end, final = points[0], [p for p in points if p["phase"] == points[0]["phase"]][-1], points[-1]
    ratio = "n/a" if first["ratio"][0] is None else f"{first['ratio'][0]['mean']:.1f}x"
    back = apart(end) - apart(final)
    return ["## CKA over training: detour vs MLM (pair) and MLM vs its seed twin (control)", "",
            "Divergence (1 - CKA, %) by layer region at every step both arms kept (every 100 steps, the end of "
            "phase 1, and the final checkpoints), mean ± std over the sampling seeds; same texts as above.", "",
            open(os.path.join(out, "trajectory", "trajectory.md")).read().split("\n", 4)[4].strip(), "",  # its rows
            "![trajectory](trajectory.png)", "", f"What this small run shows: the low layers ({low}) are already "
            f"{apart(first):.1f}% apart after {first['tokens']:,} tokens of phase 1 ({ratio} the control), "
            f"{apart(end):.1f}% at step {end['step']} (the last kept step of phase 1) and {apart(final):.1f}% after "
            "the decay, which " + (f"takes back {back:.1f} points of it." if back > 0 else "takes none of it back.")
            + f" What it does not show: this is one tiny run ({traj['settings']['n_layers']} layers, "
            f"{s['arm_tokens']:,} tokens, {len(points)} checkpoints, its regions are thirds of the layers), and the ± "
            "is over text samples, not over training seeds; it says how to read a trajectory, not when a Base model's "
            "layers 0-7 move over 10B tokens.", ""]


def report(args, s, out, task_dir, kind, timings, total):
    """report.md of the demo, made from what `out` holds, with loss.png and CKA's figures beside it. -> its text."""
    import torch
    runs = {name: metrics.records(os.path.join(out, name, "metrics.jsonl")) for name in ARMS}
    figures(out, runs, s["arm_tokens"])
    val = {name: [r for r in records if "val_mlm_loss" in r] for name, records in runs.items()}
    decay = {name: [r for r in v if r["tokens"] >= s["arm_tokens"]] for name, v in val.items()}
    steps = [r["step"] for r in decay["clm"]]
    cka, self_cka = (read_json(os.path.join(out, sub, "results.json")) for sub in ("cka", "cka_self"))
    worst = max(abs(1 - e["pair_cka"]["mean"]) for e in self_cka["layers"].values())
    evals = {name: read_json(os.path.join(out, f"eval_{name}", "results.json"))["summary"] for name in ("clm", "mlm")}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None  # where the scripts ran ("auto")
    lines = ["# CLM detour: demo report", "",
             f"Wall time {total / 60:.1f} min. Domain: "
             f"{', '.join(args.domain) if args.domain else 'built-in (PyTorch/NumPy docstrings)'}; "
             f"task: {task_dir} ({kind}); base: {args.base or 'tiny MLM on general text'}.", "", "## Settings", "",
             f"- model: configs/demo.py; base pretraining {s['base_tokens']:,} tokens"
             + (" (skipped: --base)" if args.base else ""),
             f"- each arm: {s['arm_tokens']:,} tokens of phase 1 + 10% MLM decay (15% masking), same data order",
             f"- CKA: {s['cka_n']} held-out texts x seeds 42,43,44, mean pooling, float64",
             f"- eval: {s['eval_epochs']} epochs x seeds {s['eval_seeds']}, lr {s['eval_lr']} (a tiny model takes a "
             f"larger step than the paper's 5e-5), max_len {s['eval_max_len']}",
             f"- device: {gpu + ', bfloat16' if gpu else 'CPU, float32'}; versions: Python "
             f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__} (the built-in "
             "corpora are their docstrings and the standard library's: other versions, other numbers)",
             "- steps: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()), "",
             "## Final validation loss per arm (after the decay)", "",
             "Losses to 3 decimals: " + ("a GPU computes in bfloat16, so they differ from a CPU run's." if gpu else
                                         "with other CPU kernels (AVX2 instead of AVX-512) they moved by up to 2e-5."),
             "", "| arm | phase 1 | val MLM loss (15%) | val CLM loss |", "|---|---|---|---|",
             *(f"| {name} | {' '.join(ARMS[name])} | {v[-1]['val_mlm_loss']:.3f} | {v[-1]['val_clm_loss']:.3f} |"
               for name, v in val.items()),
             "", f"## The decay: validation MLM loss at each evaluation (step {steps[0]}: the end of phase 1)", "",
             "| arm | " + " | ".join(f"step {k}" for k in steps) + " |", "|---" * (len(steps) + 1) + "|",
             *(f"| {name} | " + " | ".join(f"{r['val_mlm_loss']:.3f}" for r in v) + " |" for name, v in decay.items()),
             "", "## CKA: divergence (1 - CKA) by region, pair = clm vs mlm, control = mlm vs mlm_twin", "",
             *cka_rows(cka["regions"]), "",
             f"Sanity: CKA of the detour model with itself = 1 at every layer (max |1 - CKA| = {worst:.1e}).",
             "", "![per-layer divergence](divergence.png)", "", *trajectory_section(out, s), "",
             f"## Fine-tuning on the task (test, mean ± std over seeds {s['eval_seeds']})", "",
             "| arm | macro F1 (%) | micro F1 (%) |", "|---|---|---|",
             *(f"| {name} | {pct(f1['macro_f1'])} | {pct(f1['micro_f1'])} |" for name, f1 in evals.items()),
             "", "![loss curves](loss.png)", "", "Per-layer CKA table: cka/results.md. Logs: logs/.", ""]
    Path(out, "report.md").write_text(text := "\n".join(lines))
    return text


def task_kind(task_dir):
    """eval.py's --task for a task folder: ner for CoNLL/TSV or token/tag JSONL, multilabel for "labels", else cls."""
    names = os.listdir(task_dir)
    if any(n.endswith((".tsv", ".conll")) for n in names):
        return "ner"
    with open(os.path.join(task_dir, next(n for n in names if n.startswith("train") and n.endswith(".jsonl")))) as f:
        first = json.loads(f.readline())
    return "ner" if "tags" in first else "multilabel" if "labels" in first else "cls"


def demo(args):
    s, out, t0 = SCALES["quick" if args.quick else "full"], os.path.abspath(args.out), time.time()
    at = lambda *parts: os.path.join(out, *parts)  # noqa: E731
    os.makedirs(logs := at("logs"), exist_ok=True)
    print("1. corpora")
    build_corpora(out, s, None if args.base else "builtin", args.domain or "builtin")
    task_dir = args.task or at("task")
    kind = task_kind(task_dir)
    timings = {"corpora": time.time() - t0}
    print("2. token shards")
    shards = [("general", "bpe:4096")] * (not args.base) + [("domain", args.base or at("data", "general"))]
    timings["prepare"] = sum(run(logs, [prepare_step(out, s, name, name, tokenizer) for name, tokenizer in shards]))
    train, base = ["train.py", "configs/demo.py", *s["train"]], args.base
    if not base:
        print("3. base model: MLM on the general text")
        timings["base"] = run(logs, [("base", [  # keep_every=0, eval_interval=100: no trajectory; no curve drawn
            *train, f"--data_dir={at('data', 'general')}", f"--out_dir={at('base')}", "--init_from=scratch",
            "--objective=mlm", f"--tokens={s['base_tokens']}", "--keep_every=0", "--eval_interval=100"])])[0]
        base = at("base", "final")
    print("4. continued pretraining: the detour, the MLM arm, the MLM seed twin")
    timings.update(zip(ARMS, run(logs, [(name, [
        *train, f"--data_dir={at('data', 'domain')}", f"--out_dir={at(name)}", f"--init_from={base}",
        f"--tokens={s['arm_tokens']}", *overrides]) for name, overrides in ARMS.items()])))
    print("5. CKA: pair (clm vs mlm) and control (mlm vs mlm_twin), at the end and over training")
    final = lambda *names: [at(name, "final") for name in names]  # noqa: E731
    timings["cka"], _, timings["trajectory"] = run(logs, [
        cka_step(out, s, "cka", "--pair", *final("clm", "mlm"), "--control", *final("mlm", "mlm_twin")),
        cka_step(out, s, "cka_self", "--pair", *final("clm", "clm"), "--seeds", "42"),
        cka_step(out, s, "trajectory", "--runs", at("clm"), at("mlm"), "--control", at("mlm"), at("mlm_twin"))])
    print(f"6. fine-tuning on the task ({kind}) over seeds {s['eval_seeds']}")
    timings["eval"] = sum(run(logs, [(f"eval_{name}", [
        "eval.py", "--model", at(name, "final"), "--task", kind, "--data", task_dir, "--seeds", s["eval_seeds"],
        "--epochs", str(s["eval_epochs"]), "--lr", str(s["eval_lr"]), "--max_len", str(s["eval_max_len"]), "--out",
        at(f"eval_{name}")]) for name in ("clm", "mlm")]))
    print("7. report")
    print(report(args, s, out, task_dir, kind, timings, time.time() - t0))
    print(f"wrote {at('report.md')} ({(time.time() - t0) / 60:.1f} min)")


# -----------------------------------------------------------------------------
# The study on real text (python demo.py --study ../shared/data), fixed before its GPU run: the module's docstring.
TASKS = {"ncbi_disease": "ner", "anatem": "ner", "gad": "cls"}  # ../shared/data: diseases, anatomy (NER), GAD (cls)
STUDY = {
    # bpe: 16,384 keeps the head cheap beside a 22M-parameter body; cka_n: held-out texts per sampling seed (the
    # paper's 500); seeds: each arm's pretraining seeds (the paper's 17 and 42, and one more for an interval with 2
    # degrees of freedom), the data order fixed. reserve_s and start_s, for the time rule (study_scale): an H200
    # (results/h200-2026-11-28, which kept 180 s and 20 s and was cut in its fine-tuning) took 48 s to start the arms,
    # 26 s the base, and 220 s to fine-tune them all (CKA beside it). finetune: ELECTRA-small's GLUE recipe (Clark et
    # al. 2020), a small model's in place of the paper's Base one (5e-5, 16, 10-20 epochs): 10 times this call.
    "full": dict(docs=None, examples=None, bpe=16384, val_docs=500, heldout=1500, cka_n=500, cka_len=512,
                 seeds=(17, 42, 43), scale=1.0, minutes=8.25, reserve_s=260, start_s=35, probe_steps=60,
                 trajectory_points=8, finetune=dict(seeds=[42, 43, 44], epochs=3, lr=3e-4, batch_size=32,
                                                    warmup_ratio=0.1), train=[]),
    # the test's: every step, tiny, on the first documents of each corpus and the first examples of each split
    "quick": dict(docs=300, examples=40, bpe=1024, val_docs=20, heldout=40, cka_n=16, cka_len=128, seeds=(17, 42),
                  scale=1 / 5000, minutes=60, reserve_s=60, start_s=5, probe_steps=4, trajectory_points=2,
                  finetune=dict(seeds=[42, 43], epochs=1, lr=3e-4, batch_size=8, warmup_ratio=0.1),
                  train=["--model_config={'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 4, "
                         "'num_attention_heads': 2, 'max_position_embeddings': 128}", "--seq_len=128",
                         "--global_batch_size=4", "--micro_batch_size=4", "--warmup_tokens=1024", "--eval_windows=8",
                         "--eval_interval=10", "--log_interval=2"]),
}


def study_scale(s, elapsed, rate, sizes):
    """The time rule, written before the GPU run: the factor of every run's tokens. Pretraining gets what is left of
    `minutes` after `elapsed`, the reserve (CKA, fine-tuning, the report) and a start-up per stage (base, arms); it
    runs at the probe's MLM tokens/s (CLM steps cost about the same: the paper; H200 Base: CLM 269k, MLM 250k
    tokens/s, results/h200-2026-11-27), the arms side by side no faster than one after another, plus 10% for
    evaluations and checkpoints. sizes: every run's phase-1 tokens; each adds a 10% decay."""
    seconds = 1.1 * 1.1 * sum(sizes) / rate
    left = 60 * s["minutes"] - elapsed - s["reserve_s"] - 2 * s["start_s"]
    if left < 0.05 * seconds:
        raise SystemExit(f"the study does not fit in {s['minutes']} minutes here: {elapsed:.0f} s gone, pretraining "
                         f"at {rate:,.0f} tokens/s needs {seconds:.0f} s at full size and {left:.0f} s are left")
    return min(1.0, left / seconds)


def steady_rate(records):
    """The median tokens/s (and MFU) of a run's log records, those that counted compiling left out."""
    rows = [r for r in records if "compile_s" not in r]
    return {k: float(np.median([r[k] for r in rows])) for k in ("tokens_per_s", "mfu") if rows and k in rows[0]}


def study_report(out):
    """report.md, study.json (every number) and the figures from what `out` holds: design.json, the runs' logs, CKA's
    results and the fine-tuning runs eval.py stored. A run cut short reports the tasks all arms finished. -> its text"""
    keys = ("command", "started", "study", "arms", "pair", "control", "stages_s", "device", "torch", "factor")
    try:
        design = read_json(os.path.join(out, "design.json"))
        if not set(keys) <= set(design):
            raise ValueError(f"{out}/design.json lacks {', '.join(sorted(set(keys) - set(design)))}")
    except (OSError, ValueError) as e:
        raise SystemExit(f"--out {out}: {e}; give the folder of a study that ran past its probe") from None
    stages, names, s = dict(design["stages_s"]), list(design["arms"]), design["study"]
    if "ended" not in design:  # to the last line a step wrote (a run cut short), kept for the next report
        design["ended"] = max(entry.stat().st_mtime for entry in os.scandir(os.path.join(out, "logs")))
        Path(out, "design.json").write_text(json.dumps(design, indent=1))
    total = design["ended"] - design["started"]
    if cut := "cka and fine-tuning" not in stages:
        stages["cka and fine-tuning (cut)"] = total - sum(stages.values())
    runs = {name: metrics.records(os.path.join(out, name, "metrics.jsonl")) for name in ["base", *names]}
    figures(out, {name: runs[name] for name in names}, design["arm_tokens"])
    cka = read_json(os.path.join(out, "cka", "results.json"))
    pretraining = {}
    for name, records in runs.items():  # each phase's last evaluation (MLM, CLM loss) and its steady speed
        main, decay = ([r for r in records if r["phase"] == phase] for phase in ("main", "decay"))
        val = [{k: [r for r in rows if "val_mlm_loss" in r][-1][k] for k in ("val_mlm_loss", "val_clm_loss")}
               for rows in (main, decay)]
        pretraining[name] = {"tokens": records[-1]["tokens"], "steps": records[-1]["step"], "end_of_phase_1": val[0],
                             "after_decay": val[1], "phase_1": steady_rate(main), "decay": steady_rate(decay)}
    # The tasks every arm finished for every seed: scores[task][objective] (pretraining x fine-tuning seeds), test
    # macro F1 in points (upstream: the metric other papers report); the detour's difference over both seed levels.
    ft_seeds, scores, upstream = s["finetune"]["seeds"], {}, {}
    for t, kind in TASKS.items():
        files = {(n, f): run_file(os.path.join(out, "eval", n), t, f"{n}/final", f) for n in names for f in ft_seeds}
        for name, (objective, _) in design["arms"].items() if all(map(os.path.isfile, files.values())) else ():
            tests = [read_json(files[name, f])["result"]["test"] for f in ft_seeds]
            for into, metric in ((scores, "macro_f1"), (upstream, UPSTREAM[kind])):
                into.setdefault(t, {}).setdefault(objective, []).append([100 * r[metric] for r in tests])
    if finished := list(scores):
        scores["average"] = {o: np.mean([scores[t][o] for t in finished], axis=0).tolist() for o in ("clm", "mlm")}
    finetune = dict(metric="test macro F1 (points)", seeds=ft_seeds, pretraining_seeds=s["seeds"], finished=finished,
                    scores=scores, upstream=upstream,
                    detour_minus_mlm={t: nested_delta(x["mlm"], x["clm"]) for t, x in scores.items()},
                    twin_range={t: {o: float(np.ptp(np.mean(x[o], axis=1))) for o in x} for t, x in scores.items()})
    results = dict(design=design, minutes=total / 60, cut=cut, stages_s=stages, pretraining=pretraining,
                   cka_regions=cka["regions"], cka_layers=cka["layers"],
                   trajectory=read_json(os.path.join(out, "trajectory", "trajectory.json"))["steps"], finetune=finetune)
    Path(out, "study.json").write_text(json.dumps(results, indent=1))
    Path(out, "report.md").write_text(text := "\n".join(study_markdown(out, results)))
    return text


def study_markdown(out, results):
    """report.md's lines: the result, the fine-tuning table, then CKA, the losses, the time and the design."""
    design, finetune, s = results["design"], results["finetune"], results["design"]["study"]
    seeds, ft_seeds, finished = s["seeds"], finetune["seeds"], finetune["finished"]
    unfinished, avg = [t for t in TASKS if t not in finished], finetune["detour_minus_mlm"].get("average")
    over = f" over {', '.join(finished)}" if unfinished else " on average"
    if not finished:
        verdict = "no task finished its fine-tuning"
    elif avg["low"] is not None and (avg["low"] > 0 or avg["high"] < 0):
        verdict = (f"the detour {'leads' if avg['mean'] > 0 else 'trails'} the MLM arm by {abs(avg['mean']):.2f} "
                   f"points{over}, beyond the seeds' noise")
    else:
        verdict = f"no difference this design tells from 0{over} ({avg['mean']:+.2f} points)"
    if finished and avg["half"] is not None:
        verdict += f"; the interval's half-width, {avg['half']:.2f} points, is the smallest difference it tells from 0"
    lines = ["# The CLM detour on real text: the study's report", "",
             f"{design['device']}, torch {design['torch']}: {results['minutes']:.1f} minutes from "
             f"`{design['command']}` to {'the time limit that cut it' if results['cut'] else 'this report'}. One run, "
             "reported as it came out; its design was fixed before it ran (configs/study.py, configs/study_base.py, "
             f"demo.py's STUDY, as design.json records them). Result: {verdict}.", ""]
    if results["cut"]:
        lines += [f"The run was cut during fine-tuning: {', '.join(unfinished)} did not finish for every arm and seed "
                  f"and {'is' if len(unfinished) == 1 else 'are'} left out of the table (the runs that finished are in "
                  "eval/); everything else ran to its end.", ""]
    lines += ["## Fine-tuning: the detour minus the MLM arm (test macro F1, points)", "",
              f"Each arm's {len(seeds)} pretraining seeds ({', '.join(map(str, seeds))}) fine-tuned on each task over "
              f"{len(ft_seeds)} seeds ({', '.join(map(str, ft_seeds))}). Δ: detour minus MLM, paired by pretraining "
              f"and fine-tuning seed; its 95% interval is over the pretraining seeds' mean differences (t, "
              f"{len(seeds) - 1} df), so it holds both seed levels (support/suite.nested_delta); ±: its half-width. "
              "Twins' range: how far apart an arm's own pretraining seeds land (the spread of their means).", "",
              "| task | detour | MLM | Δ [95% interval] | ± | Δ per pretraining seed | twins' range: detour, MLM |",
              "|---|---|---|---|---|---|---|"]
    for t, d in finetune["detour_minus_mlm"].items():
        x, twins = finetune["scores"][t], finetune["twin_range"][t]
        interval = f"[{d['low']:+.2f}, {d['high']:+.2f}]" if d["low"] is not None else "(one seed: none)"
        name = f"{t} ({TASKS[t]})" if t in TASKS else f"average ({len(finished)} of {len(TASKS)} tasks)"
        lines.append(f"| {name} | {np.mean(x['clm']):.2f} | {np.mean(x['mlm']):.2f} | {d['mean']:+.2f} {interval} | "
                     f"{d['half'] or 0:.2f} | {' / '.join(f'{v:+.2f}' for v in d['per_pretraining_seed'])} | "
                     f"{twins['clm']:.2f}, {twins['mlm']:.2f} |")
    return lines + study_tables(out, results)


def study_tables(out, results):
    """report.md below the result: CKA at the end and over the run, the losses, the time, the design."""
    design, s, pretraining = results["design"], results["design"]["study"], results["pretraining"]
    losses = lambda e: f"{e['val_mlm_loss']:.3f} / {e['val_clm_loss']:.3f}"  # noqa: E731
    ft = s["finetune"]
    return [
        "", f"## CKA: divergence (1 - CKA, %) by layer region, pair = {' vs '.join(design['pair'])}, control = "
        f"{' vs '.join(design['control'])}", "",
        f"{s['cka_n']} held-out biomedical texts x sampling seeds 42, 43, 44 (mean ± std), {s['cka_len']} "
        "tokens, mean pooling, float64.", "", *cka_rows(results["cka_regions"]),
        "", "![per-layer divergence](divergence.png)", "", "## CKA over the run", "",
        open(os.path.join(out, "trajectory", "trajectory.md")).read().split("\n", 4)[4].strip(), "",
        "![trajectory](trajectory.png)", "",
        "## Validation losses (the base on general text, the arms on biomedical text; MLM at 15%)", "",
        "| run | tokens | end of phase 1: MLM / CLM | after the decay: MLM / CLM |", "|---|---|---|---|",
        *(f"| {name} | {p['tokens']:,} | {losses(p['end_of_phase_1'])} | {losses(p['after_decay'])} |"
          for name, p in pretraining.items()),
        "", "![loss curves](loss.png)", "", "## Time and throughput", "", "| stage | minutes |", "|---|---|",
        *(f"| {k} | {v / 60:.2f} |" for k, v in results["stages_s"].items()),
        f"| **total** | {results['minutes']:.2f} |", "",
        "| run | tokens/s phase 1 | tokens/s decay | MFU phase 1 |", "|---|---|---|---|",
        *(f"| {name} | {p['phase_1']['tokens_per_s']:,.0f} | {p['decay']['tokens_per_s']:,.0f} | "
          + (f"{100 * p['phase_1']['mfu']:.1f}%" if "mfu" in p["phase_1"] else "-") + " |"
          for name, p in pretraining.items()),
        "", "The arms ran side by side, their tokens/s each its own share of the device.", "",
        "## Design (fixed before the run)", "",
        "- Corpora: ../shared/data/study (general: Gutenberg books; biomedical: MedQuAD, CRAFT, PubMedQA, BioNLP; no "
        f"13-gram shared with the tasks); {s['heldout']:,} biomedical texts held out for CKA; a {s['bpe']:,}-token "
        "byte-level BPE trained on the general text (a general tokenizer meets the domain, as ModernBERT's does in "
        "the paper).",
        "- Model and optimizer: configs/study.py (the arms) and configs/study_base.py (the base).",
        f"- Sizes by the time rule (demo.py study_scale, {s['minutes']} minutes, {s['reserve_s']} s kept for CKA and "
        f"fine-tuning): the probe ran the base at {design['probe_tokens_per_s']:,.0f} tokens/s, factor "
        f"{design['factor']:.3f}: base {design['base_tokens']:,} tokens, each arm {design['arm_tokens']:,}, each + a "
        "10% MLM decay.",
        f"- Arms: {', '.join(design['arms'])}: the same base, data and data order (data_seed 42); the seed drives "
        "dropout and masking only (every arm starts from the base's weights).",
        f"- Fine-tuning: {', '.join(TASKS)}; {ft['epochs']} epoch(s), lr {ft['lr']}, batch {ft['batch_size']}, warmup "
        f"{ft['warmup_ratio']:.0%}, weight decay 0.01, best epoch by validation macro F1, seeds "
        f"{', '.join(map(str, ft['seeds']))} (suite.py).", "",
        "study.json holds every number; logs/ every run's output.", ""]


class Study:
    """One run of the study in `out`: its steps, and its design (settings, the time rule's sizes, each stage's seconds)
    in design.json, written again as each stage ends: what the report is made from, also when the run is cut short."""

    def __init__(self, args):
        import torch
        self.s = s = {**STUDY["quick" if args.quick else "full"], **({"minutes": args.minutes} if args.minutes else {})}
        self.out, data_dir = os.path.abspath(args.out), os.path.abspath(args.study)
        self.at = lambda *parts: os.path.join(self.out, *parts)
        self.corpora = {name: os.path.join(data_dir, "study", f"{name}.txt.xz") for name in ("general", "biomed")}
        self.tasks = {t: os.path.join(data_dir, t) for t in TASKS}
        if missing := [p for p in [*self.corpora.values(), *self.tasks.values()] if not os.path.exists(p)]:
            raise SystemExit(f"--study {args.study}: no {', '.join(missing)}; give the folder that holds study/ and "
                             "the tasks (../shared/data)")
        os.makedirs(self.at("logs"), exist_ok=True)
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        self.parallel = None if gpu else os.cpu_count() or 1  # the steps side by side: all on a GPU, one per CPU on CPU
        self.arms = {f"{objective}_s{seed}": (objective, seed) for objective in ("clm", "mlm") for seed in s["seeds"]}
        first, twin = s["seeds"][:2]
        self.design = dict(
            command=f"python demo.py --study {args.study}" + " --quick" * args.quick + f" --out {args.out}"
            + (f" --minutes {args.minutes}" if args.minutes else ""), started=time.time(), study=s, arms=self.arms,
            pair=[f"clm_s{first}", f"mlm_s{first}"], control=[f"mlm_s{first}", f"mlm_s{twin}"], stages_s={},
            torch=torch.__version__, python=platform.python_version(), device=gpu or "CPU")
        self.t0 = time.time()  # the start of the stage that runs now

    def stage(self, name):  # the end of a stage: its seconds said and kept in design.json; the next one starts
        self.design["stages_s"][name] = time.time() - self.t0
        print(f"{name}: {time.time() - self.t0:.0f} s ({(time.time() - self.design['started']) / 60:.1f} min in)")
        Path(self.at("design.json")).write_text(json.dumps(self.design, indent=1))
        self.t0 = time.time()

    def data(self):
        print("1. corpora: general (Gutenberg) and biomedical text, held-out biomedical texts, the tasks")
        build_corpora(self.out, self.s, [self.corpora["general"]], [self.corpora["biomed"]])
        for t, src in self.tasks.items() if self.s["examples"] else ():  # quick: the first examples of each split
            self.tasks[t] = dst = self.at("text", t)
            os.makedirs(dst, exist_ok=True)
            for name in os.listdir(src):  # a CoNLL sentence is a block, a JSONL example a line
                sep = "\n\n" if name.endswith(".tsv") else "\n"
                examples = Path(src, name).read_text(encoding="utf-8").strip("\n").split(sep)[:self.s["examples"]]
                Path(dst, name).write_text(sep.join(examples) + "\n", encoding="utf-8")
        self.stage("corpora")
        print(f"2. token shards: a {self.s['bpe']:,}-token byte-level BPE trained on the general text")
        run(self.at("logs"), [  # one after the other: the biomedical shards take the general text's tokenizer
            prepare_step(self.out, self.s, "general", "general", f"bpe:{self.s['bpe']}"),
            prepare_step(self.out, self.s, "biomed", "domain", self.at("data", "general"))])
        self.stage("prepare")

    def pretraining(self):
        s, design = self.s, self.design
        print("3. the probe: MLM steps of the base (tokens/s for the time rule), and a CLM warm-up beside it whose "
              "compiled graph the detour arms then load from inductor's cache")
        train, logs = ["train.py", "configs/study.py"], self.at("logs")
        general = lambda name, *extra: (name, [  # noqa: E731  (a run of the base's config on the general text)
            *train, "configs/study_base.py", *s["train"], f"--data_dir={self.at('data', 'general')}",
            f"--out_dir={self.at(name)}", *extra])
        probe = lambda name, objective, steps: general(  # noqa: E731
            name, f"--phases=[{{'name': '{name}', 'objective': '{objective}', 'steps': {steps}, "
            f"'warmup_steps': {steps}, 'mask_prob': {0.3 if objective == 'mlm' else 0}}}]")
        run(logs, [probe("probe", "mlm", s["probe_steps"]), probe("clm_compile", "clm", 2)], parallel=2)
        records = metrics.records(self.at("probe", "metrics.jsonl"))
        rate, per_step = steady_rate(records[1:])["tokens_per_s"], records[-1]["tokens"] // records[-1]["step"]
        sizes = {k: load_file(os.path.join(ROOT, f"configs/{name}.py"))["tokens"]
                 for k, name in (("base", "study_base"), ("arm", "study"))}
        factor = study_scale(s, time.time() - design["started"], rate,
                             [s["scale"] * sizes["base"]] + [s["scale"] * sizes["arm"]] * len(self.arms))
        base, arm = (round(factor * s["scale"] * sizes[k]) for k in ("base", "arm"))
        design.update(probe_tokens_per_s=rate, sizes=sizes, factor=factor, base_tokens=base, arm_tokens=arm,
                      keep_every=max(1, math.ceil(arm / per_step) // s["trajectory_points"]))
        self.stage("probe")
        print(f"the time rule: {rate:,.0f} tokens/s -> factor {factor:.3f}: base {base:,} tokens, each arm {arm:,} "
              f"(+10% decay each); pretraining planned to end {s['reserve_s']} s before {s['minutes']} minutes")
        print("4. the base: MLM on the general text")
        run(logs, [general("base", f"--tokens={base}")])
        self.stage("base")
        print(f"5. the arms, side by side: {', '.join(self.arms)}")
        run(logs, [(name, [*train, *s["train"], f"--data_dir={self.at('data', 'biomed')}",
                           f"--out_dir={self.at(name)}", f"--init_from={self.at('base', 'final')}",
                           f"--objective={objective}", f"--seed={seed}", f"--tokens={arm}",
                           f"--keep_every={design['keep_every']}"]) for name, (objective, seed) in self.arms.items()],
            self.parallel)
        self.stage("arms")

    def analysis(self):
        s, ft = self.s, self.s["finetune"]
        print("6. CKA (the pair and the control, at the end and over the run) and fine-tuning, side by side")
        Path(self.at("suite.py")).write_text(
            f"# The study's fine-tuning (written by demo.py --study): eval.py --suite {self.at('suite.py')} --models "
            f"ARM/final\nseeds = {ft['seeds']}\ntasks = [\n" + "".join(
                f"    dict(name={t!r}, task={kind!r}, data={self.tasks[t]!r}, epochs={ft['epochs']}, "
                f"lr={ft['lr']}, batch_size={ft['batch_size']}, warmup_ratio={ft['warmup_ratio']}),\n"
                for t, kind in TASKS.items()) + "]\n")
        runs = lambda key, sub="": [self.at(name, sub) for name in self.design[key]]  # noqa: E731
        run(self.at("logs"), [
            cka_step(self.out, s, "cka", "--pair", *runs("pair", "final"), "--control", *runs("control", "final")),
            cka_step(self.out, s, "trajectory", "--runs", *runs("pair"), "--control", *runs("control")),
            *((f"eval_{name}", ["eval.py", "--suite", self.at("suite.py"), "--models", self.at(name, "final"),
                                "--out", self.at("eval", name)]) for name in self.arms)], self.parallel)
        self.design["ended"] = time.time()
        self.stage("cka and fine-tuning")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="default out/demo (out/study with --study)")
    p.add_argument("--domain", nargs="+", help="domain text files (.txt, .jsonl, .parquet) instead of the built-in")
    p.add_argument("--task", help="a task directory for eval.py instead of the built-in")
    p.add_argument("--base", help="a Hugging Face ModernBERT directory to continue from instead of pretraining one")
    p.add_argument("--study", metavar="DATA", help="the study on real text instead: DATA holds study/general.txt.xz, "
                   f"study/biomed.txt.xz and the tasks {', '.join(TASKS)} (../shared/data)")
    p.add_argument("--quick", action="store_true", help="a tiny run of every step (what the tests use)")
    p.add_argument("--minutes", type=float, help="with --study: its time budget (default "
                   f"{STUDY['full']['minutes']}, one 9-minute GPU call); more makes the pretraining longer, up to the "
                   "full sizes of configs/study*.py")
    p.add_argument("--report", action="store_true", help="with --study: write the report again from what --out holds "
                   "(a run cut short reports the tasks every arm finished)")
    args = p.parse_args(argv)
    if args.study and (args.domain or args.task or args.base):
        p.error("--study brings its own corpora, tasks and base; --domain, --task and --base are for the demo")
    if not args.study and (args.minutes or args.report):
        p.error("--minutes and --report are for the study (--study DATA)")
    args.out = args.out or ("out/study" if args.study else "out/demo")
    sys.stdout.reconfigure(line_buffering=True)  # each line shows when it is printed, in a pipe or a log too
    if not args.study:
        return demo(args)
    if not args.report:  # the study's steps, then its report; --report: the report alone, of what --out holds
        steps = Study(args)
        steps.data()
        steps.pretraining()
        steps.analysis()
        print("7. report")
    print(study_report(out := os.path.abspath(args.out)) + f"\nwrote {os.path.join(out, 'report.md')} and study.json")


if __name__ == "__main__":
    main()
