"""
The study runner: the paper's study as a plan, one command on a laptop, one GPU or a SLURM cluster.

    python demo.py                     # the demo: 10-15 minutes on 2 free CPU cores -> out/demo/report.md
    python demo.py plans/quick.py      # every step, tiny (what the tests run)
    python demo.py plans/h200.py       # the study on real text as it ran on one H200 (results/h200-2026-11-28)
    python demo.py plans/h200.py plans/h200_sequel.py --power --pilot results/h200-2026-11-28/study
    python demo.py plans/en_base.py --slurm      # the paper's English study as SLURM jobs

A plan is plain Python, as a config is: `Plan` holds the demo's values, plan files and --key=value override them.
Its steps are the commands a user would type (steps_of): the corpora, data.py's shards, the base (MLM from scratch,
the stand-in for "a pretrained ModernBERT"), each arm at each of its pretraining seeds, cka.py on each pair and
control, eval.py --suite on each run, the report. A step whose output is there is not run again: the same command
continues a study stopped anywhere. OUT/study.json records the plan, the code's commit and the environment.
"""

import argparse
import ctypes
import json
import math
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
    # each arm's pretraining seeds: train.py's `seed` (init, dropout, masking); the data order is the same in all
    seeds: dict = field(default_factory=lambda: {"clm": [17], "mlm": [17, 42]})
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
    # how it runs: steps side by side here (0: every step that can start); sbatch options of each kind of job with
    # --slurm: "all", "train" (slurm/train.sbatch), "gpu" (cka.py, eval.py), "cpu" (corpora, data.py, the report)
    parallel: int = 1
    sbatch: dict = field(default_factory=lambda: {"gpu": ["--gpus-per-node=1"]})
    # what it costs (--power): training's and fine-tuning's tokens/s a GPU, as results/ measured them (0: unknown)
    train_tokens_per_s: float = 0.0
    finetune_tokens_per_s: float = 0.0


HOW_IT_RUNS = ("out", "parallel", "sbatch")  # the keys that change no number the study computes


def parse_plan(argv):
    """The plan of plan files and --key=value, checked, its paths absolute (the steps run from the repo root)."""
    plan = config.parse(Plan, argv)
    if problem := plan_problem(plan):
        raise SystemExit(f"{' '.join(argv) or 'the demo plan'}: {problem}")
    path = lambda p: p if p in ("", "builtin") else os.path.abspath(p)  # noqa: E731
    for key in ("general", "domain", "config", "base_config"):
        setattr(plan, key, [path(p) for p in getattr(plan, key)])
    for key in ("out", "base", "heldout_texts", "suite"):
        setattr(plan, key, path(getattr(plan, key)))
    return plan


def plan_problem(plan):
    """What makes the plan one the runner cannot run, in a line naming the fix; None if nothing."""
    if plan.baseline not in plan.arms:
        return f"baseline={plan.baseline!r} is not an arm ({', '.join(plan.arms)})"
    if set(plan.seeds) != set(plan.arms):
        return (f"`seeds` must give exactly the arms their pretraining seeds: "
                f"{', '.join(sorted(set(plan.seeds) ^ set(plan.arms)))} is in one and not the other")
    if any(not isinstance(o, list) or not all(isinstance(x, str) and x.startswith("--") and "=" in x for x in o)
           for o in plan.arms.values()):
        return "an arm is a list of train.py overrides, e.g. ['--objective=clm']"
    if any(not isinstance(s, list) or not s or len(set(s)) < len(s) or any(type(x) is not int for x in s)
           for s in plan.seeds.values()):
        return "each arm's seeds are distinct integers, e.g. seeds = {'clm': [17, 42], 'mlm': [17, 42]}"
    others = [a for a in plan.arms if a != plan.baseline]
    if not others or any(not set(plan.seeds[a]) & set(plan.seeds[plan.baseline]) for a in others):
        return "every other arm needs a pretraining seed the baseline has too: the two are compared seed by seed"
    if not plan.suite and plan.domain != ["builtin"]:
        return "no tasks: give `suite`, a suite file (suites/en_bio.py); the built-in task is the built-in domain's"
    if plan.domain_weights and not plan.heldout_texts:
        return "a mixture (domain_weights) goes to data.py whole: give its held-out texts in `heldout_texts`"
    return None


def at(plan, *parts):
    return os.path.join(plan.out, *parts)


def runs_of(plan):
    """{run: (arm, pretraining seed)}: every arm at each of its seeds."""
    return {f"{arm}_s{seed}": (arm, seed) for arm, seeds in plan.seeds.items() for seed in seeds}


def cka_pairs(plan):
    """-> (pairs, controls) of runs: each other arm against the baseline at every seed both have; the baseline's
    seeds against each other, each with the next (17-42 for two seeds; for three a ring: 17-42, 42-43, 43-17)."""
    b, seeds = plan.baseline, plan.seeds[plan.baseline]
    ring = list(zip(seeds, seeds[1:] + seeds[:1])) if len(seeds) > 2 else list(zip(seeds, seeds[1:]))
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
    kind: str = "cpu"  # "train" (slurm/train.sbatch: its requeue), "gpu" or "cpu": the job it asks for on SLURM


def steps_of(plan, argv):
    """The plan's steps in the order they can run. argv: this plan (files as absolute paths) for the runner's own."""
    def train(name, configs, data, init, tokens, extra, needs):
        return Step(name, ["train.py", *configs, *plan.train, f"--data_dir={at(plan, 'data', data)}",
                           f"--out_dir={at(plan, name)}", f"--init_from={init}", f"--tokens={tokens}", *extra], needs,
                    at(plan, name, "final", "manifest.json"), "train")

    def prepare(name, inputs, tokenizer, needs, extra=()):
        return Step(f"prepare_{name}", ["data.py", "--input", *inputs, "--tokenizer", tokenizer, "--out",
                                        at(plan, "data", name), "--val_docs", str(plan.val_docs), *extra], needs,
                    at(plan, "data", name, "meta.json"))

    steps = [Step("corpora", ["demo.py", *argv, "--step=corpora"], [], at(plan, "text", "corpora.json"))]
    if not plan.base:  # the base, pretrained here
        steps += [prepare("general", [at(plan, "text", "general.jsonl")], plan.tokenizer, ["corpora"]),
                  train("base", [*plan.config, *plan.base_config], "general", "scratch", plan.base_tokens,
                        plan.base_train, ["prepare_general"])]
    mixture = (["--weights", *map(str, plan.domain_weights)] if plan.domain_weights else []) + (
        ["--tokens", plan.domain_tokens] if plan.domain_tokens else [])
    steps.append(prepare("domain", plan.domain if plan.heldout_texts else [at(plan, "text", "domain.jsonl")],
                         plan.base or at(plan, "data", "general"), ["corpora" if plan.base else "prepare_general"],
                         mixture))
    for run, (arm, seed) in runs_of(plan).items():
        steps.append(train(run, plan.config, "domain", plan.base or at(plan, "base", "final"), plan.arm_tokens,
                           [f"--seed={seed}", *plan.arms[arm]], ["prepare_domain"] if plan.base else
                           ["prepare_domain", "base"]))
    cka = ["cka.py", "--texts", plan.heldout_texts or at(plan, "text", "heldout.jsonl"), "--n", str(plan.cka_n),
           "--max_len", str(plan.cka_len), "--seeds", plan.cka_seeds]
    pairs, controls = cka_pairs(plan)
    steps += [Step(f"cka_{a}-{b}", [*cka, "--pair", at(plan, a, "final"), at(plan, b, "final"), "--out",
                                    at(plan, "cka", f"{a}-{b}")], [a, b], at(plan, "cka", f"{a}-{b}", "results.json"),
                   "gpu") for a, b in pairs + controls]
    if plan.trajectory and controls:  # the first pair, and the first control beside it
        steps.append(Step("trajectory", [*cka, "--runs", at(plan, pairs[0][0]), at(plan, pairs[0][1]), "--control",
                                         at(plan, controls[0][0]), at(plan, controls[0][1]), "--out",
                                         at(plan, "trajectory")], [*pairs[0], *controls[0]],
                          at(plan, "trajectory", "trajectory.json"), "gpu"))
    steps += [Step(f"eval_{run}", ["eval.py", "--suite", at(plan, "suite.py"), "--models", at(plan, run, "final"),
                                   "--out", at(plan, "eval", run)], ["corpora", run],
                   at(plan, "eval", run, "results.json"), "gpu") for run in runs_of(plan)]
    return steps + [Step("report", ["demo.py", *argv, "--step=report"], [s.name for s in steps],
                         at(plan, "report.md"))]


def preflight(steps):
    """Every training's config parsed by train.py itself, in one process, before any step: a key mistyped in an arm
    is said now, not when its run starts after the base's."""
    check = "import sys, json, train\nfor argv in json.loads(sys.argv[1]): train.parse_config(argv)"
    configs = [s.cmd[1:] for s in steps if s.kind == "train"]
    r = subprocess.run([sys.executable, "-c", check, json.dumps(configs)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"the plan's training configs: {r.stderr.strip().splitlines()[-1]}")


# -----------------------------------------------------------------------------
# Running the steps: here, side by side where the plan says so, or as SLURM jobs


def die_with_parent():  # in a step's process: SIGTERM when the runner dies, even by SIGKILL (no orphan keeps a lock)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_here(plan, steps):
    """Run the steps not done, each once those it needs are done, plan.parallel at a time (0: all that can), each
    command echoed with its log (tail -f it to follow a step). Side by side, they share the CPUs unless
    OMP_NUM_THREADS says otherwise. SIGTERM or SIGINT stop the steps that run (train.py checkpoints) and then the
    runner: the same command continues."""
    done = {s.name for s in steps if os.path.exists(s.output)}
    waiting = [s for s in steps if s.name not in done]
    parallel = plan.parallel or len(waiting) or 1
    share = str(max(1, (os.cpu_count() or 1) // parallel))
    env = {**({"OMP_NUM_THREADS": share, "TORCHINDUCTOR_COMPILE_THREADS": share} if parallel > 1 else {}),
           **os.environ, "PYTHONUNBUFFERED": "1"}  # unbuffered: each line reaches the log when the child prints it
    if done:
        print(f"done earlier: {', '.join(s.name for s in steps if s.name in done)}")
    running, failed = {}, None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while (waiting and not failed) or running:
            for step in [s for s in waiting if set(s.needs) <= done][:parallel - len(running)] if not failed else []:
                waiting.remove(step)
                log = at(plan, "logs", f"{step.name}.log")
                print("$ " + shlex.join(["python", *step.cmd]).replace(ROOT + os.sep, "") + f"\n  log: {log}")
                with open(log, "a") as f:  # a rerun's after the last's
                    running[step.name] = (step, subprocess.Popen([sys.executable, *step.cmd], cwd=ROOT, stdout=f,
                                                                 stderr=subprocess.STDOUT, env=env,
                                                                 preexec_fn=die_with_parent), log, time.time())
            time.sleep(0.2)
            for step, p, log, t0 in [r for r in running.values() if r[1].poll() is not None]:
                del running[step.name]
                ok = p.returncode == 0 and os.path.exists(step.output)
                print(f"  {step.name} {'done' if ok else 'failed'} in {time.time() - t0:.0f}s")
                if ok:
                    done.add(step.name)
                failed = failed or (None if ok else (step.name, p.returncode, log))
    finally:
        for _, p, _, _ in running.values():  # stopped: train.py writes a checkpoint, which the same command resumes
            p.terminate()
        for _, p, _, _ in running.values():
            p.wait()
    if failed:
        name, code, log = failed
        raise SystemExit(f"step {name} failed (exit {code}); the same command runs it again. The end of {log}:\n"
                         + open(log).read()[-3000:])


def submit(plan, steps):
    """Every step not done as a SLURM job after the jobs of the steps it reads (afterok; a job whose dependency
    failed or was cancelled leaves the queue), its output in logs/NAME.slurm.log. Each job's id and command go to
    OUT/slurm_jobs.json as it is submitted; a study whose jobs are still queued or running is not submitted twice."""
    record = at(plan, "slurm_jobs.json")
    jobs = read_json(record, list) if os.path.exists(record) else []  # every submission's, in order
    queued = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
    if still := [f"{j['name']} ({j['id']})" for j in jobs if j["id"] in queued]:
        raise SystemExit(f"{plan.out}: jobs of its last submission are still queued or running: {', '.join(still)}; "
                         "wait for them or scancel them, then submit again")
    ids = {}
    for step in [s for s in steps if not os.path.exists(s.output)]:
        after = [ids[n] for n in step.needs if n in ids]
        script = ["slurm/train.sbatch", *step.cmd[1:]] if step.kind == "train" else ["slurm/step.sbatch", *step.cmd]
        cmd = ["sbatch", "--parsable", f"--job-name=study-{step.name}", "--kill-on-invalid-dep=yes",
               f"--output={at(plan, 'logs', step.name + '.slurm.log')}",
               *(["--dependency=afterok:" + ":".join(after)] if after else []),
               *plan.sbatch.get("all", []), *plan.sbatch.get(step.kind, []), *script]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"sbatch refused step {step.name}: {r.stderr.strip()}\n$ {shlex.join(cmd)}")
        ids[step.name] = r.stdout.strip().split(";")[0]
        jobs.append({"name": step.name, "id": ids[step.name], "command": cmd})
        replace_file(record, json.dumps(jobs, indent=1))
        print(f"job {ids[step.name]}: {step.name}" + (f" after {', '.join(after)}" if after else ""))
    print(f"{len(ids)} jobs submitted ({record}); the report will be {steps[-1].output}" if ids else
          "every step is done")


# -----------------------------------------------------------------------------
# The study's record: its plan and each session's commit and environment


def record_session(plan, argv):
    """OUT/study.json: the plan, and a line per session (the command, the code's commit, the environment), written
    before the first step. A study planned otherwise (any setting but how it runs) is refused, its differences named:
    a study's sizes and seeds are fixed before it runs."""
    import torch
    path = at(plan, "study.json")
    values = json.loads(json.dumps({k: v for k, v in asdict(plan).items() if k not in HOW_IT_RUNS}))  # as read back
    study = read_json(path) if os.path.exists(path) else {"plan": values, "sessions": []}
    if changed := sorted(k for k in values.keys() | study["plan"].keys() if values.get(k) != study["plan"].get(k)):
        raise SystemExit(f"{plan.out} holds a study planned with " + "; ".join(
            f"{k}={study['plan'].get(k)!r} (now {values.get(k)!r})" for k in changed) + ": run the same plan to "
            f"continue it, or give another --out (--base={at(plan, 'base', 'final')} reuses its base)")
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa
    study["sessions"].append({
        "argv": argv, "commit": git("rev-parse", "HEAD") or "unknown", "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "uncommitted": bool(git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU", "host": platform.node()})
    os.makedirs(at(plan, "logs"), exist_ok=True)
    replace_file(path, json.dumps(study, indent=1))


# -----------------------------------------------------------------------------
# The corpora step


def build_corpora(plan):
    """text/general.jsonl (the base's text), text/domain.jsonl and text/heldout.jsonl (the domain's texts, each
    once, shuffled with seed 0, the first `heldout` held out for CKA), the built-in task (task/: a docstring -> its
    subpackage, split 60/20/20, its texts in neither corpus), suite.py; then text/corpora.json, the step's mark."""
    from data import demo_documents, read_documents
    rng = random.Random(0)

    def docs(sources, part):  # (module, text) pairs, the first plan.docs
        texts = demo_documents(part) if sources == ["builtin"] else ((None, d) for d in read_documents(sources))
        return islice(texts, plan.docs or None)

    def jsonl(rows, *parts):
        os.makedirs(at(plan, *parts[:-1]), exist_ok=True)
        replace_file(at(plan, *parts), "".join(json.dumps(row) + "\n" for row in rows))
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
        None, [dict(name="subpackage", task="cls", data=at(plan, "task"))])
    tasks = [{**{k: v for k, v in t.items() if v is not None}, **keys} for t in tasks]
    for t in tasks if plan.examples and plan.suite else ():  # the built-in task is small already
        src, t["data"] = t["data"], at(plan, "tasks", t["name"])
        os.makedirs(t["data"], exist_ok=True)
        for name in os.listdir(src):
            sep = "\n\n" if name.endswith((".tsv", ".conll", ".txt")) else "\n"
            examples = Path(src, name).read_text(encoding="utf-8").strip("\n").split(sep)[:plan.examples]
            replace_file(os.path.join(t["data"], name), sep.join(examples) + "\n")
    replace_file(at(plan, "suite.py"), "# The study's fine-tuning, written by demo.py from its plan\n"
                 f"seeds = {plan.finetune.get('seeds', seeds)}\ntasks = [\n" + "".join(f"    {t!r},\n" for t in tasks)
                 + "]\n")
    suite.load_suite(at(plan, "suite.py"))  # checked as eval.py will read it


# -----------------------------------------------------------------------------
# The report, of what OUT holds: nothing in it says when or where a step ran, so that a study stopped and continued
# reports what an uninterrupted one does


def scores_of(out, runs):
    """{task: {run: {fine-tuning seed: {"f1": test macro F1 in points, "kept": the epoch tested, "epochs"}}}} of
    the runs eval.py stored (OUT/eval/RUN/runs/TASK/RUN/final/seedN.json): a study's, or a pilot's."""
    found = {}
    for path in sorted(Path(out, "eval").glob("*/runs/*/*/final/seed*.json")):
        if (run := path.parts[-3]) in runs:
            r = read_json(str(path))
            found.setdefault(path.parts[-4], {}).setdefault(run, {})[int(path.stem[4:])] = dict(
                f1=100 * r["result"]["test"]["macro_f1"], kept=r["result"]["best_epoch"], epochs=r["options"]["epochs"])
    return found


def differences(plan, scores):
    """Each arm against the baseline on the tasks every run finished with every fine-tuning seed, at the pretraining
    seeds both have: {"arms": {arm: {task, and "average": nested_delta}}, "finetune_seeds", "tasks"}. The average is
    per (pretraining, fine-tuning) seed first, so that it is paired as a task is."""
    ft = sorted({f for by in scores.values() for run in by.values() for f in run})
    full = [t for t, by in scores.items()
            if set(by) == set(runs_of(plan)) and all(set(ft) <= set(seeds) for seeds in by.values())]
    grid = lambda task, run: [scores[task][run][f]["f1"] for f in ft]  # noqa: E731
    arms = {}
    for arm in [a for a in plan.arms if a != plan.baseline]:
        seeds = [s for s in plan.seeds[arm] if s in plan.seeds[plan.baseline]]
        cells = {t: ([grid(t, f"{plan.baseline}_s{s}") for s in seeds], [grid(t, f"{arm}_s{s}") for s in seeds])
                 for t in full}
        if full:
            cells["average"] = tuple(np.mean([cells[t][k] for t in full], axis=0) for k in (0, 1))
        arms[arm] = {t: {**suite.nested_delta(*c), "seeds": seeds} for t, c in cells.items()}
    return {"arms": arms, "finetune_seeds": ft, "tasks": full}


def finetune_section(plan, scores, found):
    """Each arm minus the baseline with its statistics, the epochs the runs kept, and each run's scores."""
    kept = [r for by in scores.values() for run in by.values() for r in run.values()]
    last = sum(r["kept"] == r["epochs"] for r in kept)
    lines = ["## Fine-tuning: each arm minus the baseline (test macro F1, points)", "",
             f"Δ: an arm's score minus the baseline's ({plan.baseline}), paired by pretraining seed (train.py's "
             "`seed`: init, dropout, masking; the data order is every run's) and by fine-tuning seed "
             f"({', '.join(map(str, found['finetune_seeds']))}). D_s, seed s's mean difference over its fine-tuning "
             "seeds, is one draw of the design: the 95% interval is over the D_s (t), so it holds both seed levels' "
             "noise. Found with 80% power: the true difference whose interval excludes 0 80% of the time (noncentral "
             "t at the D_s's spread, never below what the fine-tuning seeds alone give), where one as large as the "
             "half-width is found 61% of the time with 3 pretraining seeds. +/-: how many D_s, and paired runs "
             "(task-averaged on the average's row), are above / below 0.", "",
             "| arm | task | Δ [95% interval] | found with 80% power | D_s +/- | runs +/- | Δ per pretraining seed |",
             "|---|---|---|---|---|---|---|"]
    for arm, by_task in found["arms"].items():
        for task, d in by_task.items():
            interval = (f"[{d['low']:+.2f}, {d['high']:+.2f}]" if d["low"] is not None else
                        "(one pretraining seed: no interval over pretraining seeds)")
            power = "n/a" if d["detectable"] is None else f"{d['detectable']:.2f}"
            signs = " | ".join(" / ".join(map(str, d["signs"][k])) for k in ("seeds", "runs"))
            each = " / ".join(f"{v:+.2f} (s{s})" for v, s in zip(d["per_pretraining_seed"], d["seeds"]))
            name = "**average**" if task == "average" else task
            lines.append(f"| {arm} | {name} | {d['mean']:+.2f} {interval} | {power} | {signs} | {each} |")
    lines += ["", f"Tasks every run finished: {', '.join(found['tasks']) or 'none'}. A fine-tuning run tests its "
              f"best epoch by validation: {last} of {len(kept)} kept their last."]
    if last > len(kept) / 2 and any(r["epochs"] > 1 for r in kept):
        lines.append("**Most runs kept their last epoch: the fine-tuning had not converged, and more epochs may "
                     "change these differences.**")
    lines += ["", "Each run (test macro F1, %, mean ± std over the fine-tuning seeds):", "",
              "| run | " + " | ".join(scores) + " |", "|---" * (len(scores) + 1) + "|"]
    for run in runs_of(plan):
        lines.append(f"| {run} | " + " | ".join(suite.pct(suite.mean_std([r["f1"] / 100 for r in by[run].values()]))
                                                if run in by else "-" for by in scores.values()) + " |")
    return lines + [""]


def cka_section(plan):
    """CKA by layer region: each arm's pairs and the controls, each a mean over its pairs, the forward's dtype."""
    pairs, controls = cka_pairs(plan)
    results = {(a, b): read_json(at(plan, "cka", f"{a}-{b}", "results.json")) for a, b in pairs + controls}
    columns = {f"{arm} vs {plan.baseline}": [results[p] for p in pairs if runs_of(plan)[p[0]][0] == arm]
               for arm in plan.arms if arm != plan.baseline}
    control = [results[p] for p in controls]
    settings = next(iter(results.values()))["settings"]
    lines = ["## CKA: divergence (1 - CKA, %) by layer region", "",
             f"Pairs: {'; '.join(f'{a} vs {b}' for a, b in results)}. Each: {settings['n']} held-out texts x sampling "
             f"seeds {', '.join(map(str, settings['seeds']))}, {settings['max_len']} tokens, mean pooling; the forward "
             f"pass in {settings['forward_dtype']}, CKA in float64. A cell: the mean over the column's pairs ± their "
             "sd (one pair: ± its sd over the sampling seeds); x: over the control's.", "",
             "| layers | " + " | ".join(f"{name} ({len(rs)} pairs)" for name, rs in columns.items())
             + (f" | control: {plan.baseline}'s seeds ({len(control)} pairs) |" if control else " |"),
             "|---" * (len(columns) + 1 + bool(control)) + "|"]
    for k, (lo, hi) in enumerate(settings["regions"]):
        def cell(rs):  # -> (the mean, its text)
            region = [r["regions"][k]["pair_divergence"] for r in rs]
            mean, sd = np.mean([d["mean"] for d in region]), region[0]["std"]
            sd = np.std([d["mean"] for d in region], ddof=1) if len(region) > 1 else sd
            return mean, f"{100 * mean:.2f} ± {100 * sd:.2f}"
        base = cell(control)[0] if control else None
        cells = [text + (f" ({mean / base:.2f}x)" if base else "") for mean, text in map(cell, columns.values())]
        lines.append(f"| {lo}-{hi - 1} | " + " | ".join(cells + [cell(control)[1]] * bool(control)) + " |")
    a, b = pairs[0]
    return lines + ["", f"![per-layer divergence, {a} vs {b}](cka/{a}-{b}/divergence.png)", ""]


def losses_section(plan):
    """Each run's validation losses at the end of phase 1 and after the decay; loss.png, its validation MLM loss."""
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    both = lambda rows: f"{rows[-1]['val_mlm_loss']:.3f} / {rows[-1]['val_clm_loss']:.3f}" if rows else "-"  # noqa
    lines = ["## Validation losses (MLM at 15% / CLM; the base on the general text, the runs on the domain's)", "",
             "| run | tokens | end of phase 1 | after the decay |", "|---|---|---|---|"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in ["base"] * (not plan.base) + list(runs_of(plan)):
        records = metrics.records(at(plan, name, "metrics.jsonl"))
        val = [r for r in records if "val_mlm_loss" in r]
        lines.append(f"| {name} | {records[-1]['tokens']:,} | {both([r for r in val if r['phase'] == 'main'])} | "
                     f"{both([r for r in val if r['phase'] == 'decay'])} |")
        if name != "base":  # a color per arm, a line style per seed
            arm, seed = runs_of(plan)[name]
            ax.plot([r["tokens"] / 1e3 for r in val], [r["val_mlm_loss"] for r in val], label=name, lw=1,
                    color=f"C{list(plan.arms).index(arm)}", ls="-:-."[plan.seeds[arm].index(seed) % 3])
    ax.axvline(plan.arm_tokens / 1e3, color="k", ls="--", lw=1, label="start of the decay")
    ax.set(xlabel="tokens of continued pretraining (thousands)", title="validation MLM loss (15% masking)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(at(plan, "loss.png"), dpi=110)
    plt.close(fig)
    return lines + ["", "![validation MLM loss](loss.png)", ""]


def report(plan):
    """report.md, and results.json (its numbers), of what OUT holds; the header names the plan, the code's commit
    and the environment of every session that ran a step (study.json), without how it ran."""
    study = read_json(at(plan, "study.json"))
    said = lambda s: (f"commit {s['commit'][:12]}" + " with uncommitted changes" * s["uncommitted"]  # noqa: E731
                      + f", Python {s['python']}, torch {s['torch']}, numpy {s['numpy']}, {s['device']}")
    sessions = list(dict.fromkeys(map(said, study["sessions"])))
    argv = [a for a in study["sessions"][0]["argv"] if not a.startswith(tuple(f"--{k}=" for k in HOW_IT_RUNS))]
    stored = scores_of(plan.out, runs_of(plan))
    scores = {t["name"]: stored[t["name"]] for t in suite.load_suite(at(plan, "suite.py"))[1]
              if t["name"] in stored}  # in the suite's order
    found = differences(plan, scores)
    lines = ["# The CLM detour study: report", "",
             "Plan: `" + shlex.join(["python", "demo.py", *argv]).replace(ROOT + os.sep, "") + "` (its values: "
             f"study.json). Code and environment: {'; continued under '.join(sessions)}.",
             f"Runs: {', '.join(runs_of(plan))}, each {plan.arm_tokens:,} tokens of phase 1 and the decay, from "
             f"{plan.base or 'the base pretrained here'}. Logs: logs/.", "",
             *finetune_section(plan, scores, found), *cka_section(plan)]
    if os.path.exists(at(plan, "trajectory", "trajectory.md")):
        shutil.copyfile(at(plan, "trajectory", "trajectory.png"), at(plan, "trajectory.png"))
        lines += ["## CKA over training: the first pair and control at every step both kept", "",
                  Path(at(plan, "trajectory", "trajectory.md")).read_text().split("\n", 4)[4].strip(), "",
                  "![trajectory](trajectory.png)", ""]
    lines += losses_section(plan)
    replace_file(at(plan, "results.json"), json.dumps({"scores": scores, **found}, indent=1))
    replace_file(at(plan, "report.md"), text := "\n".join(lines))
    return text


# -----------------------------------------------------------------------------
# Before the GPU hours: what the plan can find, and what it costs


def forecast(plan, pilot, spread):
    """The plan's tokens and GPU-hours at the throughput it names; the difference it finds with 80% power, and the
    pretraining seeds that find the paper's English gain (+0.3 to +0.8 points), at the spread of the D_s a pilot's
    variance components give for this plan's fine-tuning seeds (a finished study), or at `spread`."""
    seeds, tasks = suite.load_suite(plan.suite) if plan.suite else (None, [])
    n_ft, runs = len(plan.finetune.get("seeds") or seeds), len(runs_of(plan))
    n_pre = min(len(set(s) & set(plan.seeds[plan.baseline])) for a, s in plan.seeds.items() if a != plan.baseline)
    hours = lambda tokens, rate: (f"{tokens / rate / 3600:,.2f} GPU-hours at {rate:,.0f} tokens/s a GPU" if rate  # noqa
                                  else "GPU-hours unknown (no throughput in the plan)")
    tokens = 1.1 * (plan.base_tokens * (not plan.base) + runs * plan.arm_tokens)  # each with its 10% decay
    print(f"pretraining: {tokens / 1e6:,.1f}M tokens ({runs} runs of {plan.arm_tokens / 1e6:,.1f}M + 10%"
          + (f", the base {plan.base_tokens / 1e6:,.1f}M + 10%" if not plan.base else "") + "): "
          + hours(tokens, plan.train_tokens_per_s))
    if tasks and all(os.path.isdir(t["data"]) for t in tasks):  # a task's tokens: about its training split's bytes / 4
        epochs = sum(plan.finetune.get("epochs", t["epochs"]) for t in tasks) / len(tasks)
        tokens = epochs * n_ft * runs * sum(os.path.getsize(os.path.join(t["data"], n)) / 4 for t in tasks
                                            for n in os.listdir(t["data"]) if n.startswith("train"))
        print(f"fine-tuning: about {tokens / 1e6:,.0f}M tokens ({runs} runs x {len(tasks)} tasks x {n_ft} seeds x "
              f"{epochs:.0f} epochs): " + hours(tokens, plan.finetune_tokens_per_s))
    spreads = {"given": spread} if spread else pilot_spreads(plan, pilot, n_ft)
    print(f"| | sd of D_s | found with 80% power at {n_pre} pretraining seed(s) | seeds for +0.3 | +0.5 | +0.8 |\n"
          "|---|---|---|---|---|---|")
    for name, sd in spreads.items():
        power = suite.detectable(sd, n_pre) if n_pre > 1 else None
        print(f"| {name} | {sd:.2f} | " + ("no interval with one seed" if power is None else f"{power:.2f}") + " | "
              + " | ".join(str(suite.seeds_needed(x, sd) or "> 200") for x in (0.3, 0.5, 0.8)) + " |")


def pilot_spreads(plan, pilot, n_ft):
    """{"ARM: TASK": the spread of its D_s with n_ft fine-tuning seeds} from a finished study's fine-tuning runs, its
    runs named ARM_sSEED as this runner names them and compared as this plan compares them."""
    if not os.path.isdir(os.path.join(pilot, "eval")):
        raise SystemExit(f"--pilot {pilot}: no eval/ folder: give a study this runner ran (its OUT)")
    seeds = {}
    for arm, _, seed in (name.rpartition("_s") for name in sorted(os.listdir(os.path.join(pilot, "eval")))):
        if arm and seed.isdigit():
            seeds.setdefault(arm, []).append(int(seed))
    if plan.baseline not in seeds or len(seeds) < 2:
        raise SystemExit(f"--pilot {pilot}: no runs of the baseline {plan.baseline!r} and another arm")
    pilot_plan = Plan(**{**asdict(plan), "seeds": seeds, "arms": dict.fromkeys(seeds)})
    found = differences(pilot_plan, scores_of(pilot, runs_of(pilot_plan)))["arms"]
    spreads = {f"{arm}: {task}": suite.design_sd(d, n_ft) for arm, by in found.items() for task, d in by.items()}
    if none := [name for name, sd in spreads.items() if not sd]:
        print(f"no spread from the pilot for {', '.join(none)}: one pretraining seed, or one fine-tuning seed where "
              f"the plan has {n_ft}")
    if not (spreads := {name: sd for name, sd in spreads.items() if sd}):
        raise SystemExit(f"--pilot {pilot}: no task finished with two pretraining seeds in an arm and the baseline")
    print(f"from the pilot {pilot}: its D_s's spread with {n_ft} fine-tuning seeds (support/suite.design_sd)")
    return spreads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python demo.py [PLAN.py ...] [--key=value ...] [--slurm | --power]",
                                allow_abbrev=False)
    p.add_argument("--slurm", action="store_true", help="submit the steps left as SLURM jobs (dependencies afterok)")
    p.add_argument("--power", action="store_true", help="say what the plan finds and costs, and run nothing")
    spread = p.add_mutually_exclusive_group()
    spread.add_argument("--pilot", help="with --power: a finished study whose seed spread the plan's power is from")
    spread.add_argument("--spread", type=float, help="with --power: the standard deviation of the per-pretraining-"
                                                     "seed differences D_s, in points, instead of a pilot's")
    p.add_argument("--step", choices=["corpora", "report"], help=argparse.SUPPRESS)  # the runner's own steps
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    rest = [a if a.startswith("--") else os.path.abspath(a) for a in rest]  # jobs run plan files from the repo root
    if args.power != bool(args.pilot or args.spread is not None):
        p.error("--power takes --pilot DIR (a finished study) or --spread SD, and they are --power's only")
    if args.spread is not None and not (math.isfinite(args.spread) and args.spread > 0):
        p.error(f"--spread {args.spread}: a standard deviation above 0")
    if args.slurm and not (shutil.which("sbatch") and shutil.which("squeue")):
        p.error("--slurm: no sbatch and squeue here: submit from a SLURM login node, or run without --slurm")
    sys.stdout.reconfigure(line_buffering=True)  # each line shows when it is printed, in a pipe or a log too
    plan = parse_plan(rest)
    if args.power:
        return forecast(plan, args.pilot and os.path.abspath(args.pilot), args.spread)
    if args.step:
        return build_corpora(plan) if args.step == "corpora" else print(report(plan))
    t0, steps = time.time(), steps_of(plan, rest)
    preflight(steps)
    record_session(plan, rest)
    if args.slurm:
        return submit(plan, steps)
    run_here(plan, steps)
    print(f"wrote {at(plan, 'report.md')} ({(time.time() - t0) / 60:.1f} min)")


if __name__ == "__main__":
    main()
