"""
The study runner: the paper's study as a plan, one command on a laptop, one GPU or a SLURM cluster.

    python demo.py                     # the demo: 10-15 minutes on 2 free CPU cores -> out/demo/report.md
    python demo.py plans/quick.py      # every step, tiny (what the tests run)
    python demo.py plans/h200.py       # the study on real text as it ran on one H200 (results/h200-2026-11-28)
    python demo.py plans/h200.py plans/h200_sequel.py --power --pilot results/h200-2026-11-28/study
    python demo.py plans/en_base.py --slurm      # the paper's English study as SLURM jobs

A plan is plain Python, as a config is: `Plan` holds the demo's values, plan files and --key=value override them.
Its steps, each a command a user could type, printed as it runs, its output in OUT/logs/:
  corpora    the texts (built-in: docstrings of the standard library, and of PyTorch and NumPy with a task: which
             subpackage a docstring comes from), the held-out texts for CKA, the study's suite.py;
  prepare_*  data.py: the token shards (a byte-level BPE trained on the general text, or the base's tokenizer);
  base       train.py: MLM from scratch on the general text (the stand-in for "a pretrained ModernBERT");
  ARM_sSEED  train.py from the base on the domain text, an arm at one of its pretraining seeds, then the MLM decay;
  cka_A-B    cka.py: each arm against the baseline at each seed both have, the baseline's seeds against each other
             (the control); trajectory: the first pair and control at every step they kept;
  eval_RUN   eval.py --suite: a run fine-tuned on every task over the fine-tuning seeds;
  report     report.md: each arm minus the baseline over both seed levels, CKA, losses.
A step whose output is there is not run again: the same command continues a study stopped anywhere. OUT/study.json
records the plan, the code's commit and the environment before the first step; another plan into OUT is refused.
"""

import argparse
import ctypes
import json
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

from support import config, metrics, suite
from support.files import read_json, replace_file

ROOT = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# The plan. Defaults: the demo, a tiny ModernBERT on built-in corpora, minutes on a laptop.


@dataclass
class Plan:
    out: str = "out/demo"  # the study's folder: runs, results, logs; the same command continues a study there
    # corpora: text files (.txt, .jsonl, .parquet, .xz), or "builtin" (docstrings of the installed Python code)
    base: str = ""  # a Hugging Face ModernBERT folder to continue from; "": pretrain one here on `general`
    general: list = field(default_factory=lambda: ["builtin"])  # the base's corpus: the standard library's
    domain: list = field(default_factory=lambda: ["builtin"])  # the domain corpus: PyTorch's and NumPy's, with a task
    heldout: int = 300  # domain texts held out for CKA (never trained on), or:
    heldout_texts: str = ""  # a file of held-out texts; then the domain files go to data.py as they are, so
    domain_weights: list = field(default_factory=list)  # ... they may be a mixture (data.py --weights, --tokens)
    domain_tokens: str = ""
    docs: int = 0  # only the first `docs` documents of each corpus (0: all)
    val_docs: int = 200  # data.py --val_docs
    tokenizer: str = "bpe:4096"  # the base's, trained on `general` (data.py --tokenizer); a given base has its own
    # pretraining: train.py config files and overrides of every run, then the base's and the arms' own
    config: list = field(default_factory=lambda: ["configs/demo.py"])
    train: list = field(default_factory=list)
    base_config: list = field(default_factory=list)
    base_train: list = field(default_factory=lambda: ["--objective=mlm", "--keep_every=0", "--eval_interval=100"])
    base_tokens: int = 1_200_000
    arm_tokens: int = 600_000  # each run's phase 1; the decay adds decay_frac (the paper's 10%)
    arms: dict = field(default_factory=lambda: {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"]})
    baseline: str = "mlm"  # every other arm is compared with it; its own seeds, with each other, are the control
    seeds: dict = field(default_factory=lambda: {"clm": [17], "mlm": [17, 42]})  # each arm's pretraining seeds
    # CKA (cka.py): held-out texts per sampling seed, tokens per text, the sampling seeds; the trajectory over the
    # steps the first pair kept (train.py keep_every)
    cka_n: int = 200
    cka_len: int = 256
    cka_seeds: str = "42,43,44"
    trajectory: bool = True
    # fine-tuning: a suite file (tasks, seeds, protocol: support/suite.py), "" for the built-in task; `finetune`
    # sets the seeds and any task key for every task; `examples`: a suite task's first of each split (0: all)
    suite: str = ""
    finetune: dict = field(default_factory=lambda: {"seeds": [42, 43, 44], "epochs": 4, "lr": 5e-4, "max_len": 128})
    examples: int = 0
    # how it runs: steps side by side locally (0: every step that can start); sbatch options with --slurm
    parallel: int = 1
    sbatch: list = field(default_factory=list)  # every job's: --partition, --account, ...
    sbatch_train: list = field(default_factory=list)  # training jobs' (slurm/train.sbatch): --nodes, --gpus-per-node
    sbatch_step: list = field(default_factory=list)  # the other jobs' (slurm/step.sbatch)
    # what it costs (--power): training's and fine-tuning's tokens/s a GPU, as results/ measured them (0: unknown)
    train_tokens_per_s: float = 0.0
    finetune_tokens_per_s: float = 0.0


HOW = ("out", "parallel", "sbatch", "sbatch_train", "sbatch_step")  # how a study runs, not what it computes


def parse_plan(argv):
    """The plan of plan files and --key=value, checked, its paths absolute (the steps run from the repo root)."""
    plan, where = config.parse(Plan, argv), " ".join(argv) or "the demo plan"
    for bad, problem in [
            (set(plan.seeds) != set(plan.arms) or plan.baseline not in plan.arms,
             "`seeds` must give every arm its pretraining seeds, and `baseline` name an arm"),
            (any(not s or len(set(s)) < len(s) or any(type(x) is not int for x in s) for s in plan.seeds.values()),
             "each arm's seeds are distinct integers, e.g. seeds = {'clm': [17, 42], 'mlm': [17, 42]}"),
            (not plan.suite and plan.domain != ["builtin"],
             "no tasks: give `suite`, a suite file (suites/en_bio.py); the built-in task is the built-in domain's"),
            (plan.domain_weights and not plan.heldout_texts,
             "a mixture (domain_weights) goes to data.py whole: give its held-out texts in `heldout_texts`")]:
        if bad:
            raise SystemExit(f"{where}: {problem}")
    path = lambda p: p if p in ("", "builtin") else os.path.abspath(p)  # noqa: E731
    for key in ("general", "domain", "config", "base_config"):
        setattr(plan, key, [path(p) for p in getattr(plan, key)])
    for key in ("out", "base", "heldout_texts", "suite"):
        setattr(plan, key, path(getattr(plan, key)))
    return plan


def runs_of(plan):
    """{run: (arm, pretraining seed)}: every arm at each of its seeds."""
    return {f"{arm}_s{seed}": (arm, seed) for arm, seeds in plan.seeds.items() for seed in seeds}


def cka_pairs(plan):
    """-> (pairs, controls) of runs: each other arm against the baseline at every seed both have, and the baseline's
    seeds against each other in a ring (17-42 for two seeds; 17-42, 42-43, 43-17 for three)."""
    b, seeds = plan.baseline, plan.seeds[plan.baseline]
    ring = list(zip(seeds, seeds[1:] + seeds[:1]))[:len(seeds) if len(seeds) > 2 else len(seeds) - 1]
    return ([(f"{a}_s{s}", f"{b}_s{s}") for a in plan.arms if a != b for s in plan.seeds[a] if s in seeds],
            [(f"{b}_s{x}", f"{b}_s{y}") for x, y in ring])


# -----------------------------------------------------------------------------
# The steps


@dataclass
class Step:
    name: str  # its log: OUT/logs/NAME.log
    cmd: list  # [script, arguments...], run from the repository root
    needs: list  # the steps whose outputs it reads
    output: str  # what the step writes last: there, the step is done
    train: bool = False  # a train.py run (slurm/train.sbatch: its requeue on the time limit)


def steps_of(plan, argv):
    """The plan's steps in the order they can run. argv: this plan (files as absolute paths) for the runner's own."""
    at = lambda *parts: os.path.join(plan.out, *parts)  # noqa: E731
    train = lambda configs, data, out, init, tokens, extra: ["train.py", *configs, *plan.train,  # noqa: E731
                                                           f"--data_dir={data}", f"--out_dir={out}",
                                                           f"--init_from={init}", f"--tokens={tokens}", *extra]
    prepare = lambda name, inputs, tokenizer, extra=(): ["data.py", "--input", *inputs, "--tokenizer",  # noqa: E731
                                                         tokenizer, "--out", at("data", name), "--val_docs",
                                                         str(plan.val_docs), *extra]
    me = ["demo.py", *argv]
    steps = [Step("corpora", [*me, "--step=corpora"], [], at("text", "corpora.json"))]
    if not plan.base:
        steps += [Step("prepare_general", prepare("general", [at("text", "general.jsonl")], plan.tokenizer),
                       ["corpora"], at("data", "general", "meta.json")),
                  Step("base", train([*plan.config, *plan.base_config], at("data", "general"), at("base"), "scratch",
                                     plan.base_tokens, plan.base_train), ["prepare_general"],
                       at("base", "final", "manifest.json"), train=True)]
    mixture = ["--weights", *map(str, plan.domain_weights)] * bool(plan.domain_weights) + \
        ["--tokens", plan.domain_tokens] * bool(plan.domain_tokens)
    domain = plan.domain if plan.heldout_texts else [at("text", "domain.jsonl")]
    steps.append(Step("prepare_domain", prepare("domain", domain, plan.base or at("data", "general"), mixture),
                      ["corpora"] if plan.base else ["prepare_general"], at("data", "domain", "meta.json")))
    base = plan.base or at("base", "final")
    for run, (arm, seed) in runs_of(plan).items():
        steps.append(Step(run, train(plan.config, at("data", "domain"), at(run), base, plan.arm_tokens,
                                     [f"--seed={seed}", *plan.arms[arm]]),
                          ["prepare_domain"] + ["base"] * (not plan.base), at(run, "final", "manifest.json"), True))
    cka = ["cka.py", "--texts", plan.heldout_texts or at("text", "heldout.jsonl"), "--n", str(plan.cka_n),
           "--max_len", str(plan.cka_len), "--seeds", plan.cka_seeds]
    pairs, controls = cka_pairs(plan)
    steps += [Step(f"cka_{a}-{b}", [*cka, "--pair", at(a, "final"), at(b, "final"), "--out", at("cka", f"{a}-{b}")],
                   [a, b], at("cka", f"{a}-{b}", "results.json")) for a, b in pairs + controls]
    if plan.trajectory and pairs and controls:  # the first pair, and the first control beside it
        steps.append(Step("trajectory", [*cka, "--runs", *map(at, pairs[0]), "--control", *map(at, controls[0]),
                                         "--out", at("trajectory")], [*pairs[0], *controls[0]],
                          at("trajectory", "trajectory.json")))
    steps += [Step(f"eval_{run}", ["eval.py", "--suite", at("suite.py"), "--models", at(run, "final"), "--out",
                                   at("eval", run)], ["corpora", run], at("eval", run, "results.json"))
              for run in runs_of(plan)]
    return steps + [Step("report", [*me, "--step=report"], [s.name for s in steps], at("report.md"))]


# -----------------------------------------------------------------------------
# Running the steps: here, side by side where the plan says so, or as SLURM jobs


def die_with_parent():
    """In a step's process: SIGTERM when the runner dies, even by SIGKILL, so that no orphan keeps a run's lock."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_here(plan, steps):
    """Run the steps not done, each once those it needs are done, plan.parallel at a time (0: all that can), each
    command echoed, its output to logs/NAME.log and its latest line to the console (in place on a terminal, every
    30 s on a pipe). Side by side, they share the CPUs unless OMP_NUM_THREADS says otherwise. SIGTERM or SIGINT stop
    the steps that run (train.py checkpoints) and then the runner: the same command continues."""
    here = lambda text: text.replace(ROOT + os.sep, "")  # noqa: E731  (paths from the repo root, where it runs)
    tty, width = sys.stdout.isatty(), shutil.get_terminal_size().columns - 1  # a wrapped line is not rewritten
    clear, logs = "\r\033[K" if tty else "", os.path.join(plan.out, "logs")
    done = {s.name for s in steps if os.path.exists(s.output)}
    waiting = [s for s in steps if s.name not in done]
    parallel = plan.parallel or len(waiting) or 1
    share = str(max(1, (os.cpu_count() or 1) // parallel))
    env = {**({"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share} if parallel > 1 else {}),
           **os.environ, "PYTHONUNBUFFERED": "1"}  # unbuffered: each line reaches the log when the child prints it
    if done:
        print(f"done earlier: {', '.join(s.name for s in steps if s.name in done)}")
    running, shown, failed = {}, time.time(), None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while (waiting and not failed) or running:
            for step in [s for s in waiting if set(s.needs) <= done][:parallel - len(running)] if not failed else []:
                waiting.remove(step)
                print(clear + "$ " + here(" ".join(step.cmd)))
                with open(log := os.path.join(logs, f"{step.name}.log"), "w") as f:
                    running[step.name] = (subprocess.Popen([sys.executable, *step.cmd], cwd=ROOT, stdout=f,
                                                           stderr=subprocess.STDOUT, env=env,
                                                           preexec_fn=die_with_parent), log, time.time())
            time.sleep(0.2)
            for name in [n for n, (p, _, _) in running.items() if p.poll() is not None]:
                p, log, t0 = running.pop(name)
                ok = p.returncode == 0 and os.path.exists(next(s.output for s in steps if s.name == name))
                print(f"{clear}  {name} {'done' if ok else 'failed'} in {time.time() - t0:.0f}s, log: {here(log)}")
                done |= {name} if ok else set()
                failed = failed or (None if ok else (name, p.returncode, log))
            if running and (tty or time.time() - shown >= 30):
                print(("\r" if tty else "") + status(running)[:width if tty else None] + ("\033[K" if tty else ""),
                      end="" if tty else "\n", flush=True)
                shown = time.time()
    finally:
        for p, _, _ in running.values():  # stopped: train.py writes a checkpoint, which the same command resumes
            p.terminate()
        for p, _, _ in running.values():
            p.wait()
    if failed:
        name, code, log = failed
        raise SystemExit(f"step {name} failed (exit {code}); the same command runs it again. The end of {log}:\n"
                         + open(log).read()[-3000:])


def status(running):
    """The latest line of the oldest step running (tqdm rewrites its bar with \\r), after its seconds."""
    name, (p, log, t0) = next(iter(running.items()))
    with open(log, "rb") as f:
        f.seek(max(0, os.path.getsize(log) - 2000))
        lines = [x.strip() for x in f.read().decode(errors="replace").replace("\r", "\n").split("\n")]
    return f"  {name} {time.time() - t0:.0f}s  " + next((x for x in reversed(lines) if x), "")


def submit(plan, steps):
    """Every step not done as a SLURM job after the jobs of the steps it reads (afterok; a job whose dependency
    failed or was cancelled leaves the queue), its output in logs/NAME.slurm.log. Each job's id and command go to
    OUT/slurm_jobs.json as it is submitted; a study whose jobs are still queued or running is not submitted twice."""
    record = os.path.join(plan.out, "slurm_jobs.json")
    jobs = read_json(record, list) if os.path.exists(record) else []  # every submission's, in order
    queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
    if still := [f"{j['name']} ({j['id']})" for j in jobs if j["id"] in queued]:
        raise SystemExit(f"{plan.out}: jobs of its last submission are still queued or running: {', '.join(still)}; "
                         "wait for them or scancel them, then submit again")
    ids, first = {}, len(jobs)
    for step in [s for s in steps if not os.path.exists(s.output)]:  # each recorded once submitted (a refusal stops)
        after = [ids[n] for n in step.needs if n in ids]
        cmd = ["sbatch", "--parsable", f"--job-name=study-{step.name}", "--kill-on-invalid-dep=yes",
               f"--output={os.path.join(plan.out, 'logs', step.name + '.slurm.log')}",
               *(["--dependency=afterok:" + ":".join(after)] if after else []), *plan.sbatch,
               *(plan.sbatch_train if step.train else plan.sbatch_step),
               *(["slurm/train.sbatch", *step.cmd[1:]] if step.train else ["slurm/step.sbatch", *step.cmd])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"sbatch refused step {step.name}: {r.stderr.strip()}\n$ {' '.join(cmd)}")
        ids[step.name] = r.stdout.strip().split(";")[0]
        jobs.append({"name": step.name, "id": ids[step.name], "command": cmd})
        replace_file(record, json.dumps(jobs, indent=1))
        print(f"job {ids[step.name]}: {step.name}" + (f" after {', '.join(after)}" if after else ""))
    print(f"{len(jobs) - first} jobs submitted ({record}); the report will be {steps[-1].output}" if ids else
          "every step is done")


# -----------------------------------------------------------------------------
# The study's record: its plan and each session's commit and environment


def record_session(plan, argv):
    """OUT/study.json: the plan, and a line per session (the command, the code's commit, the environment), written
    before the first step. A study planned otherwise (any setting but how it runs) is refused, its differences named."""
    import torch
    path = os.path.join(plan.out, "study.json")
    values = json.loads(json.dumps({k: v for k, v in asdict(plan).items() if k not in HOW}))  # as it reads back
    study = read_json(path) if os.path.exists(path) else {"plan": values, "sessions": []}
    if changed := sorted(k for k in values.keys() | study["plan"].keys() if values.get(k) != study["plan"].get(k)):
        raise SystemExit(f"{plan.out} holds a study planned with " + "; ".join(
            f"{k}={study['plan'].get(k)!r} (now {values.get(k)!r})" for k in changed)
            + ": run the same plan to continue it, or give another --out")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa
    study["sessions"].append({
        "argv": argv, "commit": git("rev-parse", "HEAD") or "unknown", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "uncommitted": bool(git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU", "host": platform.node()})
    os.makedirs(os.path.join(plan.out, "logs"), exist_ok=True)
    replace_file(path, json.dumps(study, indent=1))


# -----------------------------------------------------------------------------
# The corpora step


def build_corpora(plan):
    """text/general.jsonl (the base's text), text/domain.jsonl and text/heldout.jsonl (the domain's texts, each
    once, shuffled with seed 0, the first `heldout` held out for CKA), the built-in task (task/: a docstring -> its
    subpackage, split 60/20/20, its texts in neither corpus), suite.py; then text/corpora.json, the step's mark."""
    from data import demo_documents, read_documents
    out, rng = plan.out, random.Random(0)

    def docs(sources, part):  # (module, text) pairs, the first plan.docs
        texts = demo_documents(part) if sources == ["builtin"] else ((None, d) for d in read_documents(sources))
        return islice(texts, plan.docs or None)

    def jsonl(rows, *parts):
        os.makedirs(os.path.join(out, *parts[:-1]), exist_ok=True)
        replace_file(os.path.join(out, *parts), "".join(json.dumps(row) + "\n" for row in rows))
    if not plan.base:
        jsonl(({"text": d} for _, d in docs(plan.general, "general")), "text", "general.jsonl")
    task = {"train": [], "validation": [], "test": []}
    if not plan.heldout_texts:
        labelled = list(docs(plan.domain, "domain"))
        if not plan.suite:
            packages = [(".".join(m.split(".")[:2]) if m.count(".") > 1 else None, d) for m, d in labelled]
            for c in [c for c, n in Counter(c for c, _ in packages if c).most_common(8) if n >= 5]:  # 5: one a split
                texts = [d for p, d in packages if p == c]
                picked = rng.sample(texts, min(150, len(texts)))  # 150 docstrings a class at most
                a, b = int(0.6 * len(picked)), int(0.8 * len(picked))
                for split, part in zip(task, (picked[:a], picked[a:b], picked[b:])):
                    task[split] += [{"text": d, "label": c} for d in part]
            for split, rows in task.items():
                jsonl(rows, "task", f"{split}.jsonl")
        seen = {row["text"] for rows in task.values() for row in rows}
        domain = [d for d in dict.fromkeys(d for _, d in labelled) if d not in seen]  # task texts stay unseen
        rng.shuffle(domain)
        jsonl(({"text": d} for d in domain[:plan.heldout]), "text", "heldout.jsonl")
        jsonl(({"text": d} for d in domain[plan.heldout:]), "text", "domain.jsonl")
    write_suite(plan)
    jsonl([{"docs": plan.docs, "task_examples": {k: len(v) for k, v in task.items()}}], "text", "corpora.json")


def write_suite(plan):
    """OUT/suite.py: the plan's tasks with `finetune` set for every one; with `examples`, each task's data is
    OUT/tasks/NAME, the first examples of each split (a CoNLL sentence is a block, a JSON example a line)."""
    keys = {k: v for k, v in plan.finetune.items() if k != "seeds"}
    seeds, tasks = suite.load_suite(plan.suite) if plan.suite else (
        None, [dict(name="subpackage", task="cls", data=os.path.join(plan.out, "task"))])
    tasks = [{**{k: v for k, v in t.items() if v is not None}, **keys} for t in tasks]
    for t in tasks if plan.examples and plan.suite else ():  # the built-in task is small already
        src, t["data"] = t["data"], os.path.join(plan.out, "tasks", t["name"])
        os.makedirs(t["data"], exist_ok=True)
        for name in os.listdir(src):
            sep = "\n\n" if name.endswith((".tsv", ".conll", ".txt")) else "\n"
            examples = Path(src, name).read_text(encoding="utf-8").strip("\n").split(sep)[:plan.examples]
            replace_file(os.path.join(t["data"], name), sep.join(examples) + "\n")
    replace_file(os.path.join(plan.out, "suite.py"), "# The study's fine-tuning, written by demo.py from its plan\n"
                 f"seeds = {plan.finetune.get('seeds', seeds)}\ntasks = [\n" + "".join(f"    {t!r},\n" for t in tasks)
                 + "]\n")
    suite.load_suite(os.path.join(plan.out, "suite.py"))  # checked as eval.py will read it


# -----------------------------------------------------------------------------
# The report, of what OUT holds: nothing in it says when or where a step ran, so that a study stopped and continued
# reports what an uninterrupted one does


def scores_of(out, runs):
    """{task: {run: {fine-tuning seed: (test macro F1 in points, best epoch, epochs)}}} of the runs eval.py stored
    (OUT/eval/RUN/runs/TASK/RUN/final/seedN.json): a study's, or a pilot's."""
    found = {}
    for path in sorted(Path(out, "eval").glob("*/runs/*/*/final/seed*.json")):
        if (run := path.parts[-3]) in runs:
            r = read_json(str(path))
            found.setdefault(path.parts[-4], {}).setdefault(run, {})[int(path.stem[4:])] = (
                100 * r["result"]["test"]["macro_f1"], r["result"]["best_epoch"], r["options"]["epochs"])
    return found


def differences(plan, scores):
    """{arm: {task, and "average": nested_delta}}: each arm against the baseline on the tasks every run finished with
    every fine-tuning seed, at the pretraining seeds both have. The average is per (pretraining, fine-tuning) seed
    first, so that it is paired as a task is. -> that, the fine-tuning seeds, the tasks."""
    ft = sorted({f for by in scores.values() for run in by.values() for f in run})
    full = [t for t, by in scores.items() if set(by) == set(runs_of(plan)) and all(set(ft) <= set(r) for r in
                                                                                    by.values())]
    grid = lambda task, run: [scores[task][run][f][0] for f in ft]  # noqa: E731
    out = {}
    for arm in [a for a in plan.arms if a != plan.baseline]:
        seeds = [s for s in plan.seeds[arm] if s in plan.seeds[plan.baseline]]
        cells = {t: ([grid(t, f"{plan.baseline}_s{s}") for s in seeds], [grid(t, f"{arm}_s{s}") for s in seeds])
                 for t in full}
        if full:
            cells["average"] = tuple(np.mean([cells[t][k] for t in full], axis=0) for k in (0, 1))
        out[arm] = {t: {**suite.nested_delta(*c), "seeds": seeds} for t, c in cells.items()}
    return out, ft, full


def finetune_section(plan, scores):
    """Each arm minus the baseline with its statistics, the epochs the runs kept, and each run's scores."""
    deltas, ft, full = differences(plan, scores)
    kept = [(e, n) for by in scores.values() for run in by.values() for _, e, n in run.values()]
    last = sum(e == n for e, n in kept)
    lines = ["## Fine-tuning: each arm minus the baseline (test macro F1, points)", "",
             f"Δ: an arm's score minus the baseline's ({plan.baseline}), paired by pretraining seed and by fine-tuning "
             f"seed ({', '.join(map(str, ft))}). D_s, pretraining seed s's mean difference over the fine-tuning seeds "
             "nested in it, is one draw of the design: the 95% interval is over the D_s (t), so it holds the noise of "
             "both seed levels. Found with 80% power: the true difference the design detects 80% of the time "
             "(noncentral t at the D_s's spread), not the interval's half-width, which a true difference of its size "
             "crosses about half the time. Signs: the D_s, and the paired runs, above / below 0.", "",
             "| arm | task | Δ [95% interval] | found with 80% power | D_s +/- | runs +/- | Δ per pretraining seed |",
             "|---|---|---|---|---|---|---|"]
    for arm, by_task in deltas.items():
        for task, d in by_task.items():
            lines.append(
                f"| {arm} | {'**average**' if task == 'average' else task} | {d['mean']:+.2f} "
                + (f"[{d['low']:+.2f}, {d['high']:+.2f}]" if d["low"] is not None else
                   "(one pretraining seed: no interval over pretraining seeds)")
                + f" | {'n/a' if d['detectable'] is None else format(d['detectable'], '.2f')} | "
                + " | ".join(" / ".join(map(str, d["signs"][k])) for k in ("seeds", "runs")) + " | "
                + " / ".join(f"{v:+.2f} (s{s})" for v, s in zip(d["per_pretraining_seed"], d["seeds"])) + " |")
    lines += ["", f"Tasks every run finished: {', '.join(full) or 'none'}. A fine-tuning run tests its best epoch by "
              f"validation: {last} of {len(kept)} kept their last."]
    if kept and last > len(kept) / 2:
        lines.append("**Most runs kept their last epoch: the fine-tuning had not converged, and more epochs may "
                     "change these differences.**")
    lines += ["", "Each run (test macro F1, %, mean ± std over the fine-tuning seeds):", "",
              "| run | " + " | ".join(scores) + " |", "|---" * (len(scores) + 1) + "|"]
    for run in runs_of(plan):
        lines.append(f"| {run} | " + " | ".join(suite.pct(suite.mean_std([v[0] / 100 for v in by[run].values()]))
                                                if run in by else "-" for by in scores.values()) + " |")
    return lines + [""], deltas


def cka_section(plan):
    """CKA by layer region: each arm's pairs and the controls, a mean over their pairs, the forward pass's dtype."""
    pairs, controls = cka_pairs(plan)
    at = lambda *parts: os.path.join(plan.out, *parts)  # noqa: E731
    results = {(a, b): read_json(at("cka", f"{a}-{b}", "results.json")) for a, b in pairs + controls}
    columns = {f"{arm} vs {plan.baseline}": [results[p] for p in pairs if runs_of(plan)[p[0]][0] == arm]
               for arm in plan.arms if arm != plan.baseline}
    columns = {name: rs for name, rs in columns.items() if rs}
    if controls:
        columns["control: the baseline's seeds"] = [results[p] for p in controls]
    settings = next(iter(results.values()))["settings"]
    lines = ["## CKA: divergence (1 - CKA, %) by layer region", "",
             f"Pairs: {'; '.join(f'{a} vs {b}' for a, b in results)}. Each: {settings['n']} held-out texts x sampling "
             f"seeds {', '.join(map(str, settings['seeds']))}, {settings['max_len']} tokens, mean pooling; the forward "
             f"pass in {settings['forward_dtype']}, CKA in float64. A column: the mean over its pairs ± their sd (one "
             "pair: ± over the sampling seeds). Ratio: the first column over the control.", "",
             "| layers | " + " | ".join(f"{name} ({len(rs)})" for name, rs in columns.items()) + " | ratio |" * bool(
                 controls), "|---" * (len(columns) + 1 + bool(controls)) + "|"]
    for k, (lo, hi) in enumerate(settings["regions"]):
        region = [[r["regions"][k]["pair_divergence"] for r in rs] for rs in columns.values()]
        means = [[d["mean"] for d in ds] for ds in region]
        cells = [f"{100 * np.mean(m):.2f} ± {100 * (np.std(m, ddof=1) if len(m) > 1 else ds[0]['std']):.2f}"
                 for m, ds in zip(means, region)]
        ratio = f" {np.mean(means[0]) / np.mean(means[-1]):.2f}x |" if controls and np.mean(means[-1]) > 0 else ""
        lines.append(f"| {lo}-{hi - 1} | " + " | ".join(cells) + " |" + ratio)
    a, b = next(iter(results))
    return lines + ["", f"![per-layer divergence, {a} vs {b}](cka/{a}-{b}/divergence.png)", ""]


def losses_section(plan):
    """Each run's validation losses at the end of phase 1 and after the decay, and loss.png of the arms' runs."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    runs = {name: metrics.records(os.path.join(plan.out, name, "metrics.jsonl"))
            for name in ["base"] * (not plan.base) + list(runs_of(plan))}
    both = lambda rows: f"{rows[-1]['val_mlm_loss']:.3f} / {rows[-1]['val_clm_loss']:.3f}" if rows else "-"  # noqa
    lines = ["## Validation losses (MLM at 15% / CLM; the base on the general text, the runs on the domain's)", "",
             "| run | tokens | end of phase 1 | after the decay |", "|---|---|---|---|"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for name, records in runs.items():
        val = {phase: [r for r in records if r["phase"] == phase and "val_mlm_loss" in r]
               for phase in ("main", "decay")}
        lines.append(f"| {name} | {records[-1]['tokens']:,} | {both(val['main'])} | {both(val['decay'])} |")
        if name != "base":  # a color per arm, a line style per seed
            arm, seed = runs_of(plan)[name]
            style = dict(color=f"C{list(plan.arms).index(arm)}", ls="-:-."[plan.seeds[arm].index(seed) % 3], lw=1)
            for ax, rows, key in ((axes[0], records, "loss"), (axes[1], val["main"] + val["decay"], "val_mlm_loss")):
                ax.plot([r["tokens"] / 1e3 for r in rows], [r[key] for r in rows], label=name, **style)
    for ax, title in zip(axes, ("training loss (phase 1: the arm's objective; decay: MLM 15%)",
                                "validation MLM loss (15% masking, fixed seed)")):
        ax.axvline(plan.arm_tokens / 1e3, color="k", ls="--", lw=1, label="start of the decay")
        ax.set(xlabel="tokens of continued pretraining (thousands)", title=title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(plan.out, "loss.png"), dpi=110)
    plt.close(fig)
    return lines + ["", "![loss curves](loss.png)", ""]


def report(plan):
    """report.md, and results.json (its numbers), of what OUT holds; the header names the plan, the code's commit
    and the environment of every session that ran a step (study.json), without how it ran (HOW)."""
    study = read_json(os.path.join(plan.out, "study.json"))
    said = lambda s: (f"commit {s['commit'][:12]}" + " with uncommitted changes" * s["uncommitted"]  # noqa: E731
                      + f", Python {s['python']}, torch {s['torch']}, numpy {s['numpy']}, {s['device']}")
    sessions = list(dict.fromkeys(map(said, study["sessions"])))
    argv = [a for a in study["sessions"][0]["argv"] if not a.startswith(tuple(f"--{k}=" for k in HOW))]
    found = scores_of(plan.out, runs_of(plan))
    scores = {t["name"]: found[t["name"]] for t in suite.load_suite(os.path.join(plan.out, "suite.py"))[1]
              if t["name"] in found}  # in the suite's order
    finetune, deltas = finetune_section(plan, scores)
    lines = ["# The CLM detour study: report", "",
             "Plan: `" + shlex.join(["python", "demo.py", *argv]).replace(ROOT + os.sep, "") + "` (its values: "
             f"study.json). Code and environment: {sessions[0]}" + "".join(f"; continued under {s}" for s in
                                                                            sessions[1:]) + ".",
             f"Runs: {', '.join(runs_of(plan))}, each {plan.arm_tokens:,} tokens of phase 1 and the decay, from "
             f"{plan.base or 'the base pretrained here'}. Logs: logs/.", "", *finetune, *cka_section(plan)]
    if os.path.exists(path := os.path.join(plan.out, "trajectory", "trajectory.md")):
        shutil.copyfile(os.path.join(plan.out, "trajectory", "trajectory.png"),
                        os.path.join(plan.out, "trajectory.png"))
        lines += ["## CKA over training: the first pair and control at every step both kept", "",
                  Path(path).read_text().split("\n", 4)[4].strip(), "", "![trajectory](trajectory.png)", ""]
    lines += losses_section(plan)
    replace_file(os.path.join(plan.out, "results.json"), json.dumps({"scores": scores, "differences": deltas},
                                                                    indent=1))
    replace_file(os.path.join(plan.out, "report.md"), text := "\n".join(lines))
    return text


# -----------------------------------------------------------------------------
# Before the GPU hours: what the plan can find, and what it costs


def forecast(plan, pilot, spread):
    """The plan's tokens and GPU-hours at the throughput it names, and the difference it finds with 80% power (and
    the pretraining seeds that find the paper's English gain, +0.3 to +0.8 points) from a pilot's seed spread (a
    finished study: its variance components, rescaled to this plan's fine-tuning seeds) or from `spread`, the
    standard deviation of the D_s the user expects."""
    seeds, tasks = suite.load_suite(plan.suite) if plan.suite else (None, [dict(name="subpackage", epochs=0)])
    n_ft = len(plan.finetune.get("seeds") or seeds)
    n_pre = min(len(set(s) & set(plan.seeds[plan.baseline])) for a, s in plan.seeds.items() if a != plan.baseline)
    runs, hours = len(runs_of(plan)), lambda tokens, rate: (  # noqa: E731
        f"{tokens / rate / 3600:,.2f} GPU-hours at {rate:,.0f} tokens/s a GPU" if rate else "GPU-hours unknown")
    pretraining = 1.1 * (plan.base_tokens * (not plan.base) + runs * plan.arm_tokens)  # each with its 10% decay
    print(f"pretraining: {pretraining / 1e6:,.1f}M tokens ({runs} runs of {plan.arm_tokens / 1e6:,.1f}M + 10%"
          + (f", the base {plan.base_tokens / 1e6:,.1f}M + 10%" if not plan.base else "") + "): "
          + hours(pretraining, plan.train_tokens_per_s))
    if all(os.path.isdir(t.get("data", "")) for t in tasks):  # a task's tokens: about its bytes / 4
        size = sum(os.path.getsize(os.path.join(t["data"], n)) for t in tasks for n in os.listdir(t["data"])
                   if n.startswith("train")) / 4
        epochs = sum(plan.finetune.get("epochs", t["epochs"]) for t in tasks) / len(tasks)
        tokens = size * epochs * n_ft * runs
        print(f"fine-tuning: about {tokens / 1e6:,.0f}M tokens ({runs} runs x {len(tasks)} tasks x {n_ft} seeds x "
              f"{epochs:.0f} epochs): " + hours(tokens, plan.finetune_tokens_per_s))
    else:
        print("fine-tuning: the tasks' folders are not there yet, so no estimate of its tokens")
    if pilot:
        found = {}  # the pilot's runs, ARM_sSEED as this runner names them
        for arm, seed in (name.rsplit("_s", 1) for name in sorted(os.listdir(os.path.join(pilot, "eval")))):
            found.setdefault(arm, []).append(int(seed))
        pilot_plan = Plan(**{**asdict(plan), "seeds": found, "arms": dict.fromkeys(found)})
        deltas = differences(pilot_plan, scores_of(pilot, runs_of(pilot_plan)))[0]
        spreads = {f"{arm}: {task}": suite.design_sd(d, n_ft) for arm, by in deltas.items() for task, d in by.items()}
        if not spreads or None in spreads.values():
            raise SystemExit(f"--pilot {pilot}: no finished task with two pretraining seeds in each arm: no seed "
                             "spread to plan from; give --spread")
        print(f"from the pilot {pilot}: the spread of its D_s, rescaled to {n_ft} fine-tuning seeds")
    else:
        spreads = {"given": spread}
    print(f"| | sd of D_s | found with 80% power at {n_pre} pretraining seeds | seeds for +0.3 | +0.5 | +0.8 |\n"
          "|---|---|---|---|---|---|")
    for name, sd in spreads.items():
        found = suite.detectable(sd, n_pre) if n_pre > 1 else None
        print(f"| {name} | {sd:.2f} | " + (f"{found:.2f}" if found else "no interval with one seed") + " | "
              + " | ".join(str(suite.seeds_needed(x, sd) or "> 200") for x in (0.3, 0.5, 0.8)) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python demo.py [PLAN.py ...] [--key=value ...] [--slurm | --power]",
                                allow_abbrev=False)
    p.add_argument("--slurm", action="store_true", help="submit the steps left as SLURM jobs (dependencies afterok)")
    p.add_argument("--power", action="store_true", help="say what the plan finds and costs, and run nothing")
    p.add_argument("--pilot", help="with --power: a finished study whose seed spread the plan's power is computed from")
    p.add_argument("--spread", type=float, help="with --power: the standard deviation of the per-pretraining-seed "
                                                 "differences D_s, in points, instead of a pilot's")
    p.add_argument("--step", choices=["corpora", "report"], help=argparse.SUPPRESS)  # the runner's own steps
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    rest = [a if a.startswith("--") else os.path.abspath(a) for a in rest]  # jobs run plan files from the repo root
    sys.stdout.reconfigure(line_buffering=True)  # each line shows when it is printed, in a pipe or a log too
    plan = parse_plan(rest)
    if args.power:
        if not (args.pilot or args.spread):
            p.error("--power needs --pilot DIR (a finished study) or --spread SD")
        return forecast(plan, args.pilot and os.path.abspath(args.pilot), args.spread)
    if args.step:
        return build_corpora(plan) if args.step == "corpora" else print(report(plan))
    if args.slurm and not (shutil.which("sbatch") and shutil.which("squeue")):
        p.error("--slurm: no sbatch and squeue here: submit from a SLURM login node, or run without --slurm")
    t0 = time.time()
    record_session(plan, rest)
    steps = steps_of(plan, rest)
    if args.slurm:
        return submit(plan, steps)
    run_here(plan, steps)
    print(f"wrote {os.path.join(plan.out, 'report.md')} ({(time.time() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
