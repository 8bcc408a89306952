"""
The whole study of the paper, small, on CPU, with no download: one command.

    python demo.py                       # 10-15 minutes on 2 free CPU cores -> out/demo/report.md
    python demo.py --domain ../shared/data/biomed_sentences.txt --task ../shared/data/ncbi_disease \\
                   --out out/biomed      # a small biomedical replication
    python demo.py --base path/to/ModernBERT-base --domain corpus.jsonl --task my_task/

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
The same steps on real text, sized for one GPU, ran once: results/h200-2026-11-28 (its code: demo.py --study, last
at 7cae73f).
"""

import argparse
import json
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

from support.files import read_json
from support import metrics
from support.suite import pct

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


def run(logs, steps):
    """Run steps (log name, [script, args]) one after the other as a user would: each command echoed, its output to
    logs/NAME.log, its latest line to the console (in place on a terminal, every 30 s on a pipe). -> their seconds"""
    here = lambda text: text.replace(ROOT + os.sep, "")  # noqa: E731  (paths from the repo root, where it runs)
    tty, width = sys.stdout.isatty(), shutil.get_terminal_size().columns - 1  # a wrapped line is not rewritten
    clear, took = "\r\033[K" if tty else "", []
    for name, cmd in steps:
        print(clear + "$ " + here(" ".join(cmd)))
        with open(log := os.path.join(logs, f"{name}.log"), "w") as f:  # unbuffered: each line reaches the log
            p = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        t0 = shown = time.time()
        while p.poll() is None:
            time.sleep(0.2)
            if tty or time.time() - shown >= 30:
                with open(log, "rb") as f:  # its latest line: tqdm rewrites its bar with \r
                    f.seek(max(0, os.path.getsize(log) - 2000))
                    lines = [x.strip() for x in f.read().decode(errors="replace").replace("\r", "\n").split("\n")]
                status = f"  {time.time() - t0:.0f}s  " + next((x for x in reversed(lines) if x), "")
                print("\r" + status[:width] + "\033[K" if tty else status, end="" if tty else "\n", flush=True)
                shown = time.time()
        took.append(time.time() - t0)
        print(f"{clear}  {'done' if p.returncode == 0 else 'failed'} in {took[-1]:.0f}s, log: {here(log)}")
        if p.returncode != 0:
            raise SystemExit(f"step failed (exit {p.returncode}); the end of {log}:\n{open(log).read()[-3000:]}")
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
    for (name, records), color in zip(arms.items(), ("C3", "C0", "C2")):  # tokens from 0
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo")
    p.add_argument("--domain", nargs="+", help="domain text files (.txt, .jsonl, .parquet) instead of the built-in")
    p.add_argument("--task", help="a task directory for eval.py instead of the built-in")
    p.add_argument("--base", help="a Hugging Face ModernBERT directory to continue from instead of pretraining one")
    p.add_argument("--quick", action="store_true", help="a tiny run of every step (what the tests use)")
    sys.stdout.reconfigure(line_buffering=True)  # each line shows when it is printed, in a pipe or a log too
    demo(p.parse_args(argv))


if __name__ == "__main__":
    main()
