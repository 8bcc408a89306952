"""
The whole study of the paper, small, on CPU, with no download: one command.

    python demo.py                       # 10-15 minutes on 2 free CPU cores -> out/demo/report.md
    python demo.py --domain ../shared/data/biomed_sentences.txt --task ../shared/data/ncbi_disease \\
                   --out out/biomed      # a small biomedical replication
    python demo.py --base path/to/ModernBERT-base --domain corpus.jsonl --task my_task/

Steps, each a command a user could type (printed as it runs):
  1. corpora: general and domain text (built-in: docstrings of the standard library, and of
     PyTorch and NumPy, installed with this project), held-out domain texts for CKA, and a
     downstream task (built-in: which subpackage a PyTorch/NumPy docstring comes from);
  2. data.py: a byte-level BPE trained on the general text, token shards;
  3. train.py: a tiny ModernBERT pretrained with MLM on the general text (the stand-in for
     "a pretrained ModernBERT"; skipped with --base);
  4. train.py from that base on the domain text: the CLM-detour arm, the MLM arm and an
     MLM seed twin, each followed by the MLM decay, with identical budgets;
  5. cka.py: the pair (detour vs MLM) and the control (MLM vs its seed twin), at the end and
     over training (the checkpoints each arm kept every 100 steps: keep_every in configs/demo.py);
  6. eval.py: fine-tuning of both arms on the task over 3 seeds;
  7. report.md with the tables, loss.png, divergence.png and trajectory.png.
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

ROOT = os.path.dirname(os.path.abspath(__file__))

# Sizes. "full" is the demo; "quick" is the test's: every step, tiny, on the first 2,000 docstrings of each
# corpus, with as many held-out texts as the README's cka.py commands draw. train: train.py overrides.
SCALES = {
    "full": dict(docs=None, base_tokens=1_200_000, arm_tokens=600_000, heldout=300, cka_n=200, task_per_class=150,
                 eval_epochs=4, eval_lr=5e-4, eval_seeds="42,43,44", eval_max_len=128, train=[]),
    "quick": dict(docs=2000, base_tokens=20_000, arm_tokens=10_000, heldout=200, cka_n=16, task_per_class=12,
                  eval_epochs=1, eval_lr=5e-4, eval_seeds="42,43", eval_max_len=32,
                  train=["--eval_windows=8", "--keep_every=4"]),
}
ARMS = {  # name -> train.py overrides on top of configs/demo.py; identical budgets
    "clm": ["--objective=clm"],
    "mlm": ["--objective=mlm"],
    "mlm_twin": ["--objective=mlm", "--seed=42"],  # seed-noise control: same data order, other seed
}


def run(cmd, log):
    """Run one step as a user would, echoing the command. Its output goes to the log file and its latest
    line to the console as it comes: rewritten in place on a terminal, one line every 30 s on a pipe (CI)."""
    here = lambda text: text.replace(ROOT + os.sep, "")  # noqa: E731  (paths from the repo root, where it runs)
    print("$ " + here(" ".join(cmd[1:] if cmd[0] == sys.executable else cmd)), flush=True)
    t0 = shown = time.time()
    tty, width = sys.stdout.isatty(), shutil.get_terminal_size().columns - 1  # a wrapped line is not rewritten
    # Unbuffered, so each line arrives when the child prints it; text mode also splits \r updates into lines.
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    with open(log, "w") as f:
        for line in p.stdout:
            f.write(line)
            status = f"  {time.time() - t0:.0f}s  {line.strip()}"
            if tty and line.strip():
                print("\r" + status[:width] + "\033[K", end="", flush=True)  # \033[K clears the rest of the line
            elif line.strip() and time.time() - shown >= 30:
                print(status, flush=True)
                shown = time.time()
    ok = p.wait() == 0
    end = f"  {'done' if ok else 'failed'} in {time.time() - t0:.0f}s, log: {here(log)}"
    print(("\r\033[K" if tty else "") + end, flush=True)
    if not ok:
        raise SystemExit(f"step failed (exit {p.returncode}); the end of {log}:\n{open(log).read()[-3000:]}")
    return time.time() - t0


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def builtin_task(docs, per_class, rng):
    """Docstring -> its subpackage (torch.nn, torch.distributions, numpy.linalg, ...): the eight most
    frequent with 5 docstrings or more, up to per_class examples each, split 60/20/20."""
    def package(module):
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else None
    counts = Counter(package(m) for m, _ in docs if package(m))
    classes = [c for c, n in counts.most_common(8) if n >= 5]  # 60/20/20 of 5 leaves each split one
    by_class = {c: [d for m, d in docs if package(m) == c] for c in classes}
    task = {"train": [], "validation": [], "test": []}
    for c in classes:
        picked = rng.sample(by_class[c], min(per_class, len(by_class[c])))
        a, b = int(0.6 * len(picked)), int(0.8 * len(picked))
        for split, part in (("train", picked[:a]), ("validation", picked[a:b]), ("test", picked[b:])):
            task[split] += [{"text": d, "label": c} for d in part]
    return task


def build_corpora(args, s, out):
    """general.jsonl, domain.jsonl, heldout.jsonl and, for the built-in task, task/{train,validation,test}.jsonl."""
    from data import demo_documents, read_documents

    docs = lambda part: islice(demo_documents(part), s["docs"])  # noqa: E731
    rng = random.Random(0)
    os.makedirs(os.path.join(out, "text"), exist_ok=True)
    path = lambda name: os.path.join(out, "text", name)  # noqa: E731
    if not args.base:
        write_jsonl(path("general.jsonl"), ({"text": d} for _, d in docs("general")))
    if args.domain:
        domain = list(read_documents(args.domain))
        task_docs = set()
    else:
        labelled = list(docs("domain"))
        task = builtin_task(labelled, s["task_per_class"], rng)
        os.makedirs(os.path.join(out, "task"), exist_ok=True)
        for split, rows in task.items():
            write_jsonl(os.path.join(out, "task", f"{split}.jsonl"), rows)
        task_docs = {row["text"] for rows in task.values() for row in rows}
        domain = [d for _, d in labelled]
    domain = [d for d in dict.fromkeys(domain) if d not in task_docs]  # the task's texts stay unseen
    rng.shuffle(domain)
    write_jsonl(path("heldout.jsonl"), ({"text": d} for d in domain[:s["heldout"]]))
    write_jsonl(path("domain.jsonl"), ({"text": d} for d in domain[s["heldout"]:]))
    return args.task or os.path.join(out, "task")


def task_type(task_dir):
    """ner for CoNLL/TSV or token/tag JSONL, multilabel for "labels", cls for "label"."""
    names = os.listdir(task_dir)
    if any(n.endswith((".tsv", ".conll")) for n in names):
        return "ner"
    train = next(n for n in names if n.startswith("train") and n.endswith(".jsonl"))
    with open(os.path.join(task_dir, train)) as f:
        first = json.loads(f.readline())
    return "ner" if "tags" in first else "multilabel" if "labels" in first else "cls"


def last_val(metrics_path):
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]
    return next(r for r in reversed(records) if "val_mlm_loss" in r), records


def loss_figure(arms, main_tokens, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(16, 4))
    kilo = lambda records: [r["tokens"] / 1e3 for r in records]  # noqa: E731
    for (name, records), color in zip(arms.items(), ("C3", "C0", "C2")):  # each arm counts tokens from 0
        val = [r for r in records if "val_mlm_loss" in r]
        left.plot(kilo(records), [r["loss"] for r in records], color=color, label=name)
        mid.plot(kilo(val), [r["val_mlm_loss"] for r in val], "o-", ms=3, color=color, label=name)
        # The decay alone, where the detour returns to MLM: validation from the end of phase 1 on, and the
        # training loss, which in the decay is the same MLM loss (15%) on the training batches.
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trajectory_section(out, s):
    """The trajectory's table (divergence by region at every kept step), its figure, and what it says."""
    shutil.copyfile(os.path.join(out, "trajectory", "trajectory.png"), os.path.join(out, "trajectory.png"))
    traj = json.load(open(os.path.join(out, "trajectory", "trajectory.json")))
    table = open(os.path.join(out, "trajectory", "trajectory.md")).read().split("\n", 4)[4]  # rows, not headings
    points = traj["steps"]
    low = traj["settings"]["regions"][0]
    pct = lambda p: 100 * p["pair"]["regions"][0]["mean"]  # noqa: E731  (the low region)
    first, end, final = points[0], [p for p in points if p["phase"] == points[0]["phase"]][-1], points[-1]
    ratio = "n/a" if first["ratio"][0] is None else f"{first['ratio'][0]['mean']:.1f}x"
    back = pct(end) - pct(final)
    return ["## CKA over training: detour vs MLM (pair) and MLM vs its seed twin (control)", "",
            "Divergence (1 - CKA, %) by layer region at every step both arms kept (every 100 steps, the end of "
            "phase 1, and the final checkpoints), mean ± std over the sampling seeds; same texts as above.", "",
            table.strip(), "", "![trajectory](trajectory.png)", "",
            f"What this small run shows: the low layers ({low}) are already {pct(first):.1f}% apart after "
            f"{first['tokens']:,} tokens of phase 1 ({ratio} the control), {pct(end):.1f}% at step {end['step']} "
            f"(the last kept step of phase 1) and {pct(final):.1f}% after the decay, which "
            + (f"takes back {back:.1f} points of it." if back > 0 else "takes none of it back.")
            + f" What it does not show: this is one tiny run ({traj['settings']['n_layers']} layers, "
            f"{s['arm_tokens']:,} tokens, {len(points)} checkpoints, its regions are thirds of the layers), and the "
            "± is over text samples, not over training seeds; it says how to read a trajectory, not when a Base "
            "model's layers 0-7 move over 10B tokens.", ""]


def report(args, s, out, task_dir, kind, timings, total):
    import numpy
    import torch

    arms = {name: last_val(os.path.join(out, name, "metrics.jsonl")) for name in ARMS}
    loss_figure({name: records for name, (_, records) in arms.items()}, s["arm_tokens"], os.path.join(out, "loss.png"))
    shutil.copyfile(os.path.join(out, "cka", "divergence.png"), os.path.join(out, "divergence.png"))
    cka = json.load(open(os.path.join(out, "cka", "results.json")))
    self_cka = json.load(open(os.path.join(out, "cka_self", "results.json")))
    evals = {name: json.load(open(os.path.join(out, f"eval_{name}", "results.json"))) for name in ("clm", "mlm")}

    pct = lambda x: f"{100 * x['mean']:.2f} ± {100 * x['std']:.2f}"  # noqa: E731
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None  # where the scripts ran ("auto")
    lines = ["# CLM detour: demo report", "",
             f"Wall time {total / 60:.1f} min. Domain: "
             f"{', '.join(args.domain) if args.domain else 'built-in (PyTorch/NumPy docstrings)'}; "
             f"task: {task_dir} ({kind}); base: {args.base or 'tiny MLM on general text'}.",
             "", "## Settings", "",
             f"- model: configs/demo.py; base pretraining {s['base_tokens']:,} tokens" + (" (skipped: --base)" if args.base else ""),
             f"- each arm: {s['arm_tokens']:,} tokens of phase 1 + 10% MLM decay (15% masking), same data order",
             f"- CKA: {s['cka_n']} held-out texts x seeds 42,43,44, mean pooling, float64",
             f"- eval: {s['eval_epochs']} epochs x seeds {s['eval_seeds']}, lr {s['eval_lr']} (a tiny model takes a "
             f"larger step than the paper's 5e-5), max_len {s['eval_max_len']}",
             f"- device: {gpu + ', bfloat16' if gpu else 'CPU, float32'}; versions: Python "
             f"{platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__} (the built-in "
             "corpora are their docstrings and the standard library's: other versions, other numbers)",
             "- steps: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()), "",
             "## Final validation loss per arm (after the decay)", "",
             "Losses to 3 decimals: " + ("a GPU computes in bfloat16, so they differ from a CPU run's." if gpu else
                                         "with other CPU kernels (AVX2 instead of AVX-512) they moved by up to 2e-5."),
             "",
             "| arm | phase 1 | val MLM loss (15%) | val CLM loss |", "|---|---|---|---|"]
    for name, (rec, _) in arms.items():
        lines.append(f"| {name} | {' '.join(ARMS[name])} | {rec['val_mlm_loss']:.3f} | {rec['val_clm_loss']:.3f} |")
    decay = {name: [r for r in records if "val_mlm_loss" in r and r["tokens"] >= s["arm_tokens"]]
             for name, (_, records) in arms.items()}
    steps = [r["step"] for r in decay["clm"]]
    lines += ["", f"## The decay: validation MLM loss at each evaluation (step {steps[0]}: the end of phase 1)", "",
              "| arm | " + " | ".join(f"step {k}" for k in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for name, val in decay.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['val_mlm_loss']:.3f}" for r in val) + " |")
    lines += ["", "## CKA: divergence (1 - CKA) by region, pair = clm vs mlm, control = mlm vs mlm_twin", "",
              "| layers | pair (%) | control (%) | ratio |", "|---|---|---|---|"]
    for r in cka["regions"]:
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']['mean']:.2f}x"
        lines.append(f"| {r['layers']} | {pct(r['pair_divergence'])} | {pct(r['control_divergence'])} | {ratio} |")
    worst = max(abs(1 - e["pair_cka"]["mean"]) for e in self_cka["layers"].values())
    lines += ["", f"Sanity: CKA of the detour model with itself = 1 at every layer (max |1 - CKA| = {worst:.1e}).",
              "", "![per-layer divergence](divergence.png)", "", *trajectory_section(out, s), "",
              f"## Fine-tuning on the task (test, mean ± std over seeds {s['eval_seeds']})", "",
              "| arm | macro F1 (%) | micro F1 (%) |", "|---|---|---|"]
    for name, res in evals.items():
        lines.append(f"| {name} | {pct(res['summary']['macro_f1'])} | {pct(res['summary']['micro_f1'])} |")
    lines += ["", "![loss curves](loss.png)", "", "Per-layer CKA table: cka/results.md. Logs: logs/.", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo")
    p.add_argument("--domain", nargs="+", help="domain text files (.txt, .jsonl, .parquet) instead of the built-in")
    p.add_argument("--task", help="a task directory for eval.py instead of the built-in")
    p.add_argument("--base", help="a Hugging Face ModernBERT directory to continue from instead of pretraining one")
    p.add_argument("--quick", action="store_true", help="a tiny run of every step (what the tests use)")
    args = p.parse_args(argv)
    s = SCALES["quick" if args.quick else "full"]
    out = os.path.abspath(args.out)
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    py = sys.executable
    t_start, timings = time.time(), {}

    print("1. corpora", flush=True)
    t0 = time.time()
    task_dir = build_corpora(args, s, out)
    kind = task_type(task_dir)
    timings["corpora"] = time.time() - t0

    print("2. token shards", flush=True)
    text = lambda name: os.path.join(out, "text", name)  # noqa: E731
    data = lambda name: os.path.join(out, "data", name)  # noqa: E731
    timings["prepare"] = 0.0
    if not args.base:
        timings["prepare"] += run([py, "data.py", "--input", text("general.jsonl"), "--tokenizer", "bpe:4096",
                                   "--out", data("general"), "--val_docs", "200"], os.path.join(logs, "prepare_general.log"))
    tokenizer = args.base or data("general")
    timings["prepare"] += run([py, "data.py", "--input", text("domain.jsonl"), "--tokenizer", tokenizer,
                               "--out", data("domain"), "--val_docs", "200"], os.path.join(logs, "prepare_domain.log"))

    common = [py, "train.py", "configs/demo.py", *s["train"]]
    base = args.base
    if not base:
        print("3. base model: MLM on the general text", flush=True)
        timings["base"] = run(common + [f"--data_dir={data('general')}", f"--out_dir={os.path.join(out, 'base')}",
                                        "--init_from=scratch", "--objective=mlm", f"--tokens={s['base_tokens']}",
                                        "--keep_every=0", "--eval_interval=100"],  # no trajectory; no curve drawn
                              os.path.join(logs, "base.log"))
        base = os.path.join(out, "base", "final")

    print("4. continued pretraining: the detour, the MLM arm, the MLM seed twin", flush=True)
    for name, overrides in ARMS.items():
        timings[name] = run(common + [f"--data_dir={data('domain')}", f"--out_dir={os.path.join(out, name)}",
                                      f"--init_from={base}", f"--tokens={s['arm_tokens']}", *overrides],
                            os.path.join(logs, f"{name}.log"))

    print("5. CKA: pair (clm vs mlm) and control (mlm vs mlm_twin), at the end and over training", flush=True)
    final = lambda name: os.path.join(out, name, "final")  # noqa: E731
    cka = [py, "cka.py", "--texts", text("heldout.jsonl"), "--n", str(s["cka_n"]), "--max_len", "256"]
    timings["cka"] = run(cka + ["--pair", final("clm"), final("mlm"), "--control", final("mlm"), final("mlm_twin"),
                                "--out", os.path.join(out, "cka")], os.path.join(logs, "cka.log"))
    run(cka + ["--pair", final("clm"), final("clm"), "--seeds", "42", "--out", os.path.join(out, "cka_self")],
        os.path.join(logs, "cka_self.log"))
    arm = lambda name: os.path.join(out, name)  # noqa: E731
    timings["trajectory"] = run(cka + ["--runs", arm("clm"), arm("mlm"), "--control", arm("mlm"), arm("mlm_twin"),
                                       "--out", os.path.join(out, "trajectory")], os.path.join(logs, "trajectory.log"))

    print(f"6. fine-tuning on the task ({kind}) over seeds {s['eval_seeds']}", flush=True)
    timings["eval"] = 0.0
    for name in ("clm", "mlm"):
        timings["eval"] += run([py, "eval.py", "--model", final(name), "--task", kind, "--data", task_dir,
                                "--seeds", s["eval_seeds"], "--epochs", str(s["eval_epochs"]), "--lr", str(s["eval_lr"]),
                                "--max_len", str(s["eval_max_len"]), "--out", os.path.join(out, f"eval_{name}")],
                               os.path.join(logs, f"eval_{name}.log"))

    print("7. report", flush=True)
    report(args, s, out, task_dir, kind, timings, time.time() - t_start)
    print(open(os.path.join(out, "report.md")).read())
    print(f"wrote {os.path.join(out, 'report.md')} ({(time.time() - t_start) / 60:.1f} min)")


if __name__ == "__main__":
    main()
