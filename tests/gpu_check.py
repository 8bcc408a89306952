"""
The GPU check: what a session with a lent GPU runs first, one command that writes one folder.

    python tests/gpu_check.py --parts c e --budget c=330 e=200 --out results/DEVICE-DATE/check_ce  # < 10 minutes
    python tests/gpu_check.py --parts f --budget f=520 --out results/DEVICE-DATE/check_f     # the step's ceiling
    python tests/gpu_check.py --parts g --budget g=520 --out results/DEVICE-DATE/check_g     # against transformers
    python tests/gpu_check.py --tiny --out /tmp/gpu_check     # the same code on CPU, tiny sizes

It runs the project's scripts as a user does and tables what they wrote: a. tests/test_gpu.py; b. bench.py at the
paper's shape; c. train.py compiled (Base, 4 x 8192 tokens, CLM -> MLM 30% -> MLM 15% decay), its phase-2 checkpoint
resumed under torchrun, SIGTERM'd once it logs a step, resumed again; d. bench.py --largest; e. on c's runs, eval.py
on a task of each type and cka.py --pair and --runs, each against the same under torchrun or on CPU; demo.py
plans/quick.py; f. the step at the paper's shape against the GPU's ceiling: compiled whole (profiled) and by regions,
cold and warm, Liger-Kernel's fused kernels (with its wheel carried), each attention kernel; g. ours compiled against
transformers compiled, packed at the paper's shape, CLM and MLM; h. the same at 32 x 1,024 tokens and variable-length.
--tiny: every part at tiny sizes on CPU (tests/test_bench.py). A part's time limit (BUDGETS, --budget) gains what
the parts before left; at the limit the running command gets SIGINT (pytest writes its junit file), then SIGKILL with
its process group, and the next part runs. Writes OUT/report.md, report.json, logs/; never imports torch or downloads.
"""

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# Seconds per part, from the H200 runs (results/h200-2026-11-2[67]; a Base graph compiles in 45-75 s): a's 15 tests
# cut at 280 s; b's bench.py processes 111-251 s each; c: data 11 s, the whole run 182 s, each torchrun resume 90 s
# (its graph compiled for 60 s again); d 42 s; e: eval.py 22-32 s x 3, cka.py 10-12 s x 4, demo.py plans/quick.py ~150 s.
# f, g, h: from those (a bench.py process of ours compiled 110-190 s, by regions ~100) and results/h200-2026-11-28
# (attention 37 s; transformers' compiled MLM over 114 s): h is two calls' work, its 1,024-token rows fit one.
BUDGETS = {"a": 330, "b": 780, "c": 390, "d": 60, "e": 290, "f": 520, "g": 520, "h": 1000}
# c's train.py runs log what inductor's caches do, for caches() (2 s more at each start: those runs only), in these
# words (found() takes them as patterns: they hold no regex characters)
CACHE_LOGS = dict(TORCH_LOGS="torch._inductor.codecache,torch._functorch._aot_autograd.autograd_cache")
CACHE_LINES = {"fx_graph hits": "fx graph cache hit for key", "fx_graph misses": "fx graph cache miss for key",
               "fx_graph bypassed": "Bypassing FX Graph Cache", "aot_autograd hits": "AOTAutograd cache hit",
               "aot_autograd misses": "AOTAutograd cache miss", "aot_autograd bypassed": "Bypassing autograd cache"}
SIZES = {  # runs: b's, f's and g's bench.py runs, "all" or "first"; bench_s: the seconds each of its rows is timed;
    # phases: c's steps, the decay outlasting a SIGTERM; examples: e's
    "full": dict(bench="base", bench_s=3, runs="all", seq_len=8192, micro=4, phases=(4, 4, 8), probe=["base", "large"],
                 cap=64, examples=64, model={"vocab_size": 50368}),
    "tiny": dict(bench="tiny", bench_s=0.02, runs="first", seq_len=64, micro=2, phases=(4, 4, 60), probe=["tiny"],
                 cap=4, examples=32,
                 model=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                            local_attention=16)),
}
MACHINE = ("import json, os, platform, torch; from importlib.metadata import version; p = torch.cuda."
           "get_device_properties(0) if torch.cuda.is_available() else None; print(json.dumps(dict(device=p.name if p "
           "else f'CPU, {os.cpu_count()} cores', memory_gib=p and round(p.total_memory / 2 ** 30, 1), cuda=p is not "
           "None, torch=torch.__version__, cuda_version=torch.version.cuda, python=platform.python_version(), "
           "transformers=version('transformers'), triton=p and version('triton'))))")  # run apart: it imports torch
outcome = lambda code: "timeout" if code is None else "done" if code == 0 else f"exit {code}"  # noqa: E731


def run(cmd, log, deadline, env=None, sigterm=None):
    """-> (exit code, None if the deadline came first; seconds). sigterm(): when true, the command gets SIGTERM."""
    if time.time() > deadline - 2:
        open(log, "w").write("not run: the part's time was spent\n")
        return None, 0.0
    print("  $ " + shlex.join(["python", *cmd[1:]] if cmd[0] == PY else cmd).replace(ROOT + os.sep, "")[:300])
    started = time.time()
    with open(log, "w") as f:  # SIGINT as in a terminal, which a shell's background jobs (nohup ... &) ignore
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            while p.poll() is None and time.time() < deadline:
                time.sleep(0.2)
                if sigterm and sigterm():  # as a scheduler sends it (torchrun passes it on to its worker), once
                    os.kill(p.pid, signal.SIGTERM)
                    sigterm = None
        finally:  # the deadline, or this check stopped: nothing of the command's group outlives it
            code = p.poll()
            if code is None:  # SIGINT first: 10 s to write what it finished (pytest: its junit file)
                os.killpg(p.pid, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    quiet = time.time() - os.path.getmtime(log)  # a command that said its last line and then hung: how long
    print(f"    {outcome(code)} in {time.time() - started:.0f} s, {quiet:.0f} s after its last output: {log}",
          flush=True)
    return code, time.time() - started


def found(pattern, path):  # in a file, or [] where it is not (yet)
    return re.findall(pattern, open(path, errors="replace").read()) if os.path.isfile(path) else []


def metrics(out_dir):  # its whole lines: a running train.py may be writing the last one
    return [json.loads(line) for line in found(r"(.+)\n", os.path.join(out_dir, "metrics.jsonl"))]


def numbers(obj, path=""):
    """{path: number} of a JSON document: what two runs of one script compare."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    return {path: obj} if isinstance(obj, float) else {k: v for key, x in items for k, v in numbers(
        x, f"{path}/{key}").items()}


def worst(a, b, relative=False):
    """The largest difference between the numbers of two runs (relative: to b's); inf where they have others."""
    a, b = numbers(a), numbers(b)
    diffs = [abs(a[k] - b[k]) / (abs(b[k]) if relative and b[k] else 1) for k in a] if set(a) == set(b) else []
    return max(diffs, default=float("inf"))


def pytest_tests(path, log, deadline):
    """pytest without pytest.ini's options -> (exit code, each test from its junit file: written on SIGINT too)."""
    junit, tests = log.replace(".log", "_junit.xml"), []
    code, _ = run([PY, "-m", "pytest", path, "-o", "addopts=", "-rA", "-p", "no:cacheprovider", "-o",
                   "junit_logging=system-out", f"--junitxml={junit}"], log, deadline)
    for case in ET.parse(junit).getroot().iter("testcase") if os.path.exists(junit) else []:
        tag = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), None)
        detail = case.find(tag).get("message") if tag else case.findtext("system-out")
        tests.append(dict(test=case.get("name"), outcome={"failure": "failed", None: "passed"}.get(tag, tag), seconds=(
            round(float(case.get("time") or 0), 1)), detail=" ".join((detail or "").split())[:300]))
    return code, [t for t in tests if t["test"]]  # the test an interrupt stopped: an element without a name


def correctness(ctx, deadline):
    code, tests = pytest_tests("tests/test_gpu.py", ctx.log("a_pytest.log"), deadline)
    count = ", ".join(f"{n} {k}" for k in ("passed", "failed", "error", "skipped")
                      if (n := sum(t["outcome"] == k for t in tests))) or "no test finished"
    why = "cut short by the time limit: " if code is None else "" if ctx.env["cuda"] else "no CUDA, so all skip: "
    return dict(ok=code == 0 if ctx.env["cuda"] or code != 0 else None, summary=why + count, tests=tests)


def bench(ctx, deadline, name, *args, env=None):
    """bench.py ARGS (later ones win) at this check's sizes -> (its JSON: a failed worker's run writes the others'
    rows, a cut one nothing; what ran)."""
    s, out = ctx.size, ctx.log(f"{name}.json")
    with contextlib.suppress(FileNotFoundError):
        os.remove(out)  # an earlier check's, in the same folder
    code, seconds = run([PY, "bench.py", "--seq_len", str(s["seq_len"]), "--batch_size", str(s["micro"]), "--min_time",
                         str(s["bench_s"]), "--warmup", "2", *args, "--out", out], ctx.log(f"{name}.log"), deadline,
                        env)
    return read_json(out), dict(run=name, outcome=outcome(code), seconds=round(seconds))


def read_json(path):  # {} where a command cut short left none, or half of one
    try:
        return json.load(open(path))
    except (FileNotFoundError, ValueError):
        return {}


def runs_of(ctx, each):  # tiny: the first only
    return each if ctx.size["runs"] == "all" else each[:1]


def verdict(runs):
    """bench.py's runs -> (ok: False where one exited with an error, None where one was cut, "N of M" done)."""
    done = sum(r["outcome"] == "done" for r in runs)
    return False if "exit" in str(runs) else done == len(runs) or None, f"{done} of {len(runs)}"


def speed(ctx, deadline):
    rows, runs, each = [], [], [("packed", "clm"), ("packed", "mlm"), ("variable", "mlm"), ("variable", "clm")]
    for case, objective in runs_of(ctx, each):  # a bench.py process each, train.py's packed batches first
        out, ran = bench(ctx, deadline, f"b_{case}_{objective}", "--size", ctx.size["bench"], "--cases", case,
                         "--objectives", objective, "--skip", "attention")
        rows, runs = rows + out.get("step", []), runs + [ran]
    ok, done = verdict(runs)
    return dict(ok=ok, rows=rows, runs=runs, summary=f"{done} measured" + "".join(
        f"; {r['impl']} {r['case']} {r['objective']}: MFU {r['MFU']}, {r['vs_transformers']} transformers"
        for r in rows if "comp" in r["impl"]))


def memory(ctx, deadline):
    rows = []
    for size in ctx.size["probe"]:
        out, ran = bench(ctx, deadline, f"d_{size}", "--size", size, "--largest", str(ctx.size["cap"]), "--skip",
                         "step", "attention")
        rows += [dict(size=size, **r) for r in out.get("largest", [dict(largest=ran["outcome"])])]
    return dict(ok=all(isinstance(r["largest"], int) for r in rows) or None, rows=rows, summary=", ".join(
        f"{r['size']} {r.get('objective', '')} {r['largest']}" for r in rows))


def training(ctx, deadline):
    s, cuda, n, data = ctx.size, ctx.env["cuda"], ctx.size["phases"], os.path.join(ctx.work, "data")
    run([PY, "data.py", "--demo", "general", "--tokenizer", "bpe:4096", "--out", data, "--val_docs", "2000"],
        ctx.log("data.log"), deadline)  # docstrings, a BPE trained here
    phases = [dict(name="clm", objective="clm", steps=n[0], warmup_steps=1),
              dict(name="mlm", objective="mlm", mask_prob=0.3, steps=n[1]),
              dict(name="decay", objective="mlm", mask_prob=0.15, steps=n[2], decay=True)]
    args = ["train.py", f"--data_dir={data}", f"--model_config={s['model']!r}", f"--seq_len={s['seq_len']}",
            f"--micro_batch_size={s['micro']}", f"--global_batch_size={2 * s['micro']}", f"--phases={phases!r}",
            "--log_interval=1", "--eval_interval=1000000", "--eval_windows=8", "--ckpt_interval=1000000",
            "--ckpt_every_minutes=0", f"--compile={'True' if cuda else 'aot_eager'}"]  # CPU: no C++ build
    whole, resumed, log = ctx.whole, os.path.join(ctx.work, "c_resumed"), ctx.log("c_whole.log")
    code, seconds = run([PY, *args, f"--out_dir={whole}"], log, deadline, CACHE_LOGS)
    if code != 0:
        return dict(ok=False, summary=f"train.py {outcome(code)}: see logs/c_whole.log")
    records, rows = metrics(whole), []
    for phase in phases:
        mine = [r for r in records if r["phase"] == phase["name"]]
        step_s, mfu = [2 * s["micro"] * s["seq_len"] / r["tokens_per_s"] for r in mine], [r.get("mfu") for r in mine]
        rows.append(dict(phase=phase["name"], steps=len(mine), first_step_s=round(step_s[0], 3), steady_step_s=round(
            statistics.median(step_s[1:]), 3), steady_mfu=None if None in mfu else f"{statistics.median(mfu[1:]):.1%}",
            compile_s=sum(r.get("compile_s", 0) for r in mine)))
    line = (found(r"outside the steps: (.*)", log) or [""])[-1]  # train.py's end line (support/metrics.py)
    said = dict(zip(("evaluations", "evaluation_s", "checkpoints", "checkpoint_s", "longest_checkpoint_s", "graphs",
                     "compile_s", "graph_breaks", "recompiles"), map(json.loads, re.findall(r"\d+(?:\.\d+)?", line))))
    said.update(recompile_reasons=line.partition("recompiles: ")[2],
                peak_memory="".join(found(r"peak memory (.*)", log)[-1:]))
    vals = [r["val_mlm_loss"] for r in records if "val_mlm_loss" in r]
    fell = 1 - vals[-1] / vals[0]  # it learns: its val MLM loss falls 0.2% or more (the tiny CPU run's: 0.7%)
    learning = dict(ok=fell >= 0.002, fell=fell, summary=f"val MLM loss {vals[0]:.4f} -> {vals[-1]:.4f} ({-fell:+.2%})")
    # The resume, under torchrun: the phase-2 checkpoint in a new out_dir (hard links: checkpoints are never written
    # in place), SIGTERM once it logs a step, the same command again, its losses against the uninterrupted run's.
    start, first, second = n[0] + n[1], ctx.log("c_resume_1.log"), ctx.log("c_resume_2.log")
    shutil.copytree(os.path.join(whole, f"ckpt-{start}"), os.path.join(resumed, f"ckpt-{start}"), copy_function=os.link)
    code1 = run([*TORCHRUN, *args, f"--out_dir={resumed}"], first, deadline, CACHE_LOGS,
                sigterm=lambda: os.path.isfile(os.path.join(resumed, "metrics.jsonl")))[0]
    stopped = [int(x) for x in found(r"stopped by SIGTERM at step (\d+)", first)]
    code2 = run([*TORCHRUN, *args, f"--out_dir={resumed}"], second, deadline, CACHE_LOGS)[0] if stopped else (
        "not run")
    a, b = ({r["step"]: {k: v for k, v in r.items() if k.endswith("loss")} for r in got if r["step"] > start}
            for got in (records, metrics(resumed)))
    resume = dict(exit_on_sigterm=code1, stopped_at=stopped, exit_after=code2, wrote_final=bool(found(
        r"\ndone: ", second)), steps=sorted(b), max_rel_diff=worst(
        a, b, True), resumed_at=[int(x) for log in (first, second) for x in found(r"resuming at step (\d+)", log)])
    resume["ok"] = code2 == 0 and resume["resumed_at"] == [start, *stopped] and resume["max_rel_diff"] <= (
        0.01 if cuda else 0)  # GPU: the attention backward's atomics add in any order
    return dict(ok=learning["ok"] and resume["ok"] and said.get("graph_breaks") == 0, phases=rows, learning=learning,
                said=dict(said, whole_run_s=round(seconds, 1)), resume=resume, caches=[caches(x) for x in (
                    log, first, second)], summary=f"{learning['summary']}: it "
                f"{'learns' if learning['ok'] else 'does NOT learn'}; {said.get('graphs')} graphs compiled in "
                f"{said.get('compile_s')} s, {said.get('graph_breaks')} graph breaks, {said.get('recompiles')} "
                f"recompiles; the resume under torchrun {'continues' if resume['ok'] else 'does NOT continue'} the run")


def caches(log):
    """What inductor's caches did in a train.py run, from its log: hits, misses, bypasses and why. A resumed run
    compiles the whole run's graphs again, each a hit where the caches work (torch 2.11 on an H200: 60 s, as cold)."""
    why = found(r"Bypassing (?:FX Graph Cache because|autograd cache due to:) ([^\n]+)", log)  # "Won't cache ..."
    return dict(run=os.path.basename(log), **{k: len(found(line, log)) for k, line in CACHE_LINES.items()},
                why="; ".join(sorted(set(w.strip(" '") for w in why)))[:300])


def write_tasks(folder, n):
    """A task of each type for eval.py --suite, n training examples each: does a sentence name a place (cls), which
    places (multilabel), where (ner: words of several sub-words); the texts for cka.py."""
    rng, files, places = random.Random(0), {}, ["Ouagadougou", "Antananarivo", "Tegucigalpa", "Kaohsiung", "Wollongong"]
    rows = [[rng.choice(places) if rng.random() < 0.15 else rng.choice(["the", "a", "of", "in", "by", "model"])
             for _ in range(rng.randint(4, 12))] for _ in range(2 * n)]
    for split, part in (("train", rows[:n]), ("validation", rows[n:]), ("test", rows[n:])):
        files[f"cls/{split}.jsonl"] = [dict(text=" ".join(w), label=str(bool(set(w) & set(places)))) for w in part]
        files[f"multilabel/{split}.jsonl"] = [dict(text=" ".join(w), labels=sorted(set(w) & set(places))) for w in part]
        files[f"ner/{split}.jsonl"] = [dict(tokens=w, tags=["B-LOC" if x in places else "O" for x in w]) for w in part]
    files["texts.jsonl"] = [dict(text=" ".join(w)) for w in rows]
    for name, lines in files.items():
        os.makedirs(os.path.join(folder, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)
    with open(os.path.join(folder, "suite.py"), "w") as f:
        f.write("seeds = [42]\ntasks = [dict(name=t, task=t, data=t, epochs=1, batch_size=8, lr=1e-4, max_len=64, "
                "max_tokens=4096) for t in ('cls', 'multilabel', 'ner')]\n")


def scripts(ctx, deadline):
    w, whole, rows, runs, tiny = ctx.work, ctx.whole, [], {}, not ctx.env["cuda"]  # tiny: CPU against CPU, identical
    if not os.path.isdir(os.path.join(whole, "final")):
        return dict(ok=False, summary="part e fine-tunes and compares part c's runs: run them together (--parts c e)")

    def step(name, started, ok, **figures):  # a row of the report
        rows.append(dict(step=name, seconds=round(time.time() - started), ok={True: "yes", False: "NO"}.get(ok, "-"),
                         figures="; ".join(f"{k}: {v:.2e}" if isinstance(v, float) else f"{k}: {v}"
                                           for k, v in figures.items())))

    write_tasks(os.path.join(w, "tasks"), ctx.size["examples"])
    for name, launch, extra in (("one", [PY], []), ("torchrun", TORCHRUN, []),
                                ("cpu", [PY], ["--device", "cpu", "--dtype", "float32"])):
        out, started = os.path.join(w, f"e_eval_{name}"), time.time()
        code = run([*launch, "eval.py", "--suite", os.path.join(w, "tasks", "suite.py"), "--models",
                    os.path.join(whole, "final"), "--out", out, *extra], ctx.log(f"e_eval_{name}.log"), deadline)[0]
        runs[name] = {p.split(os.sep)[-4]: json.load(open(p))["result"]  # OUT/runs/TASK/c_whole/final/seed42.json
                      for p in glob.glob(os.path.join(out, "runs", "*", "*", "*", "seed*.json"))}
        step(f"eval.py, {name}", started, code == 0 and len(runs[name]) == 3, exit=code, **{
            task: f"test macro F1 {r['test']['macro_f1']:.3f}" for task, r in runs[name].items()})
    of = lambda name, key: {task: r[key] for task, r in runs[name].items()}  # noqa: E731
    diffs = dict(test_scores=worst(of("one", "test"), of("torchrun", "test")), first_losses=worst(
        of("one", "first_losses"), of("torchrun", "first_losses"), True), first_losses_against_cpu_float32=worst(
        of("one", "first_losses"), of("cpu", "first_losses"), True))  # on a GPU: within bf16 noise
    step("eval.py: under torchrun and on CPU against one process", time.time(), all(
        d <= (0 if tiny else tol) for d, tol in zip(diffs.values(), (0.05, 0.01, 0.03))), **diffs)
    cka = [PY, "cka.py", "--texts", os.path.join(w, "tasks", "texts.jsonl"), "--n", str(ctx.size["examples"]),
           "--seeds", "42", "--max_len", "64", "--dtype", "float32"]
    for what, given, stem in (("pair", [f"{whole}/ckpt-{ctx.size['phases'][0]}", f"{whole}/final"], "results"),
                              ("runs", [whole, f"{w}/c_resumed"], "trajectory")):
        results, started = [], time.time()
        for device in ("auto", "cpu"):
            out = os.path.join(w, f"e_cka_{what}_{device}")
            code = run([*cka, f"--{what}", *given, "--device", device, "--out", out], ctx.log(f"e_cka_{what}_{device}"
                       ".log"), deadline, env=dict(NVIDIA_TF32_OVERRIDE="0"))[0]
            results.append(json.load(open(os.path.join(out, f"{stem}.json"))) if code == 0 else None)
        step(f"cka.py --{what}: GPU against CPU", started, worst(*results) <= 1e-5, max_abs_diff=worst(*results),
             numbers_compared=len(numbers(results[0])))
    started, code = time.time(), "not at tiny sizes: tests/test_demo.py runs it" if tiny else run(
        [PY, "demo.py", "plans/quick.py", f"--out={os.path.join(w, 'e_demo')}"], ctx.log("e_demo.log"), deadline)[0]
    step("demo.py plans/quick.py", started, None if tiny else code == 0, exit=code)
    bad = [r["step"] for r in rows if r["ok"] == "NO"]
    return dict(ok=not bad, steps=rows, summary="; ".join(f"NOT ok: {b}" for b in bad) or f"none of {len(rows)} failed")


def ceiling(ctx, deadline):
    """The step at the paper's shape, packed, ours alone, a bench.py process each: compiled whole, CLM then MLM (as
    train.py's detour and decay: MLM's graph compiles beside CLM's kernels), profiled in logs/profile_packed_*.txt; by
    regions, CLM, compiled from a cache of its own, then again from that cache (what a resumed run compiles); Liger-
    Kernel's fused kernels against inductor's fusions of ours (tests/liger.py, where liger_kernel is installed: it says
    how to bring it); each attention kernel alone. Each cache starts empty: a folder of this check's, inductor's and
    Triton's."""
    s, rows, runs, objectives = ctx.size, [], [], runs_of(ctx, ("clm", "mlm"))

    def steps(name, impl, cache, *args):
        folder = os.path.join(ctx.work, f"f_cache_{cache}")
        out, ran = bench(ctx, deadline, name, "--size", s["bench"], "--cases", "packed", "--skip", "attention",
                         "--impls", impl, *args, env=dict(TORCHINDUCTOR_CACHE_DIR=folder,
                                                          TRITON_CACHE_DIR=os.path.join(folder, "triton")))
        rows.extend(dict(run=name, **r) for r in out.get("step", []))
        runs.append(ran)

    for objective in objectives:
        steps(f"f_packed_{objective}", "ours compiled", "whole", "--objectives", objective, "--profile",
              os.path.dirname(ctx.log("f")))
    for name in ("f_regions", "f_regions_warm"):
        steps(name, "ours regional", "regions", "--objectives", objectives[0])
    liger, said = [], "not run: liger_kernel is not installed"
    if importlib.util.find_spec("liger_kernel"):  # found, not imported: this check never imports torch
        code = run([PY, "tests/liger.py", "--out", ctx.log("f_liger.json"), *([] if ctx.env["cuda"] else ["--tiny"])],
                   ctx.log("f_liger.log"), min(deadline, time.time() + 200))[0]  # ~120 s on an H200
        liger = [r["cells"] for r in read_json(ctx.log("f_liger.json")).get("rows", [])]
        said = f"{outcome(code)}: " + ", ".join(f"{r['piece']} {r['ours / liger']}" for r in liger)
    out, ran = bench(ctx, deadline, "f_attention", "--size", s["bench"], "--cases", "packed", "--skip", "step",
                     "--attn_kernels", "varlen", "cudnn", "sdpa", "--min_time", str(min(s["bench_s"], 0.3)))
    attention, runs = out.get("attention", []), runs + [ran]
    measured = "; ".join(f"{r['objective']} {r['impl']}{' warm' * r['run'].endswith('warm')}: MFU {r['MFU']}, "
                         f"warm-up {r['warmup_s']} s" for r in rows)
    kernels = {}  # the fastest forward on each layer type and mask
    for r in sorted((r for r in attention if "fwd_ms" in r), key=lambda r: float(r["fwd_TFLOP/s"])):
        kernels[f"{r['layer']} {'causal' if r['causal'] else 'bidirectional'}"] = r
    ok, done = verdict(runs)
    return dict(ok=ok, rows=rows, liger=liger, attention=attention, runs=runs, summary=f"{done} bench.py runs; "
                f"{measured}; Liger-"
                f"Kernel (ours / Liger) {said}; attention (TFLOP/s, forward / backward 2.5x): " + ", ".join(
                    f"{k} {r['backend']} {r['fwd_TFLOP/s']} / {r['bwd_TFLOP/s_2.5x']}" for k, r in kernels.items()))


def rivals(ctx, deadline, part, shapes):
    """Ours compiled against transformers' ModernBERT compiled (which runs CLM bidirectionally: it has no causal mask),
    a bench.py process for each shape and objective, CLM then MLM -> the part's result."""
    rows, runs = [], []
    for shape, objective in runs_of(ctx, [(x, o) for x in shapes for o in ("clm", "mlm")]):
        (seq, micro), name = shapes[shape], f"{part}_{shape}_{objective}"
        out, ran = bench(ctx, deadline, name, "--size", ctx.size["bench"], "--seq_len", str(seq), "--batch_size",
                         str(micro), "--cases", "variable" if shape == "variable" else "packed", "--objectives",
                         objective, "--impls", "ours compiled", "transformers compiled", "--skip", "attention")
        rows += [dict(run=name, shape=f"{micro} x {seq}", **r) for r in out.get("step", [])]
        runs.append(ran)
    ours = [r for r in rows if r["impl"] == "ours compiled"]
    ahead = sum(r["vs_transformers"] != "-" and float(r["vs_transformers"][:-1]) > 1 for r in ours)
    ok, done = verdict(runs)
    return dict(ok=ok, rows=rows, runs=runs, summary=(
        f"{done} bench.py runs; ahead of transformers compiled in {ahead} of {len(ours)} rows: "
        + ", ".join(f"{r['run'][2:]} {r['shape']} {r['vs_transformers']}" for r in ours)))


def rivals_packed(ctx, deadline):  # the paper's shape
    return rivals(ctx, deadline, "g", dict(packed=(ctx.size["seq_len"], ctx.size["micro"])))


def rivals_short(ctx, deadline):  # ModernBERT's pretraining length (32 x 1,024 at Base), then variable-length batches
    seq, micro = ctx.size["seq_len"], ctx.size["micro"]
    return rivals(ctx, deadline, "h", dict(short=(seq // 8, 8 * micro), variable=(seq, micro)))


TITLES = {"a": "Correctness: tests/test_gpu.py", "b": "Speed: bench.py", "c": "train.py, and its resume under torchrun",
          "d": "Memory: bench.py --largest", "e": "eval.py, cka.py and demo.py on the GPU",
          "f": "The step at the ceiling: compiled whole and by regions, Liger-Kernel, attention",
          "g": "Against transformers compiled: packed, the paper's shape",
          "h": "Against transformers compiled: packed at ModernBERT's pretraining length, variable-length"}
PARTS = {"a": correctness, "b": speed, "c": training, "d": memory, "e": scripts, "f": ceiling, "g": rivals_packed,
         "h": rivals_short}


def md_table(rows):
    """A list of dicts, or a dict as (what, value) rows, as a markdown table (dicts and lists in it: report.json's)."""
    rows = [dict(what=k, value=v) for k, v in rows.items()] if isinstance(rows, dict) else rows
    columns = list(dict.fromkeys(c for r in rows for c, v in r.items() if not isinstance(v, (dict, list))))
    cells = [["-" if r.get(c) is None else str(r[c]).replace("|", "/") for c in columns] for r in rows]
    return ["", f"| {' | '.join(columns)} |", "|" + "---|" * len(columns), *(f"| {' | '.join(c)} |" for c in cells)]


def write_report(out, results):
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    env, parts = results["env"], results["parts"]
    lines = [f"# GPU check: {env['device']}, {results['date']}", "", f"`{results['command']}`: "
             f"{results['seconds']:.0f} s.", *md_table([env]), *md_table([dict(
                 part=k, title=TITLES[k], status=p["status"], seconds=f"{p['seconds']:.0f} / {p['limit']:.0f}",
                 ok={True: "yes", False: "NO"}.get(p["ok"], "-"), summary=p["summary"]) for k, p in parts.items()])]
    for key, part in parts.items():  # its tables; an error's traceback is in report.json
        lines += ["", f"## {key}. {TITLES[key]}", "", part["summary"]]
        lines += [line for x in part.values() if isinstance(x, (dict, list)) and x for line in md_table(x)]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the folder for report.md, report.json and logs/")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: every part on CPU in a few minutes")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--budget", nargs="+", default=[], metavar="PART=SECONDS", help=f"defaults: {BUDGETS}",
                   type=lambda x: (x.partition("=")[0], float(x.partition("=")[2])))
    args = p.parse_args(argv)
    if set(budgets := {**BUDGETS, **dict(args.budget)}) != set(PARTS):
        p.error(f"--budget: PART=SECONDS, with PART one of {', '.join(PARTS)}")
    return args, budgets


def main(argv=None):
    args, budgets = parse_args(argv)
    logs = os.path.join(args.out, "logs")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: run()'s finally stops the running command
    os.makedirs(logs, exist_ok=True)
    run([PY, "-c", MACHINE], os.path.join(logs, "machine.log"), time.time() + 120)
    env = json.loads((found(r"\{.*\}", os.path.join(logs, "machine.log")) or ["{}"])[-1])
    if not env.get("cuda") and not (args.tiny and env):
        raise SystemExit("no CUDA device here (logs/machine.log): the full check is for a GPU; --tiny runs the same "
                         "parts at tiny sizes on CPU")
    results = dict(command=shlex.join(["python", "tests/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
                   date=time.strftime("%Y-%m-%d %H:%M"), env=env, budgets=budgets, parts={})
    started, work, spare = time.time(), tempfile.mkdtemp(prefix="gpu_check_"), 0.0  # spare: what parts left unused
    ctx = argparse.Namespace(work=work, env=env, size=SIZES["tiny" if args.tiny else "full"],
                             whole=os.path.join(work, "c_whole"), log=lambda name: os.path.join(logs, name))
    try:
        for key in args.parts:
            limit, t0 = budgets[key] + spare, time.time()
            print(f"\n{key}. {TITLES[key]} (limit {limit:.0f} s)", flush=True)
            try:
                part = PARTS[key](ctx, t0 + limit)
            except Exception as e:  # noqa: BLE001 (one part's bug must not cost the others their run)
                part = dict(ok=False, summary=f"{type(e).__name__}: {e}", error=traceback.format_exc())
            part.update(status="error" if "error" in part else "timeout" if time.time() > t0 + limit - 2 else "done",
                        seconds=time.time() - t0, limit=limit)
            spare, results["parts"][key] = max(0, limit - part["seconds"]), part
            results["seconds"] = time.time() - started
            print(f"  -> {part['status']}: {part['summary']}", flush=True)
            write_report(args.out, results)  # after every part: a check stopped from outside still leaves a report
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {os.path.join(args.out, 'report.md')} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
