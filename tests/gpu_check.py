"""
The GPU check: what a session with a lent GPU runs first, as one command that writes one folder.

    python tests/gpu_check.py --out results/gpu_check          # one H100/H200: about 25 minutes
    python tests/gpu_check.py --parts a --out /tmp/a           # or in calls of under 10 minutes: 5.5 minutes,
    python tests/gpu_check.py --parts c d --out /tmp/cd        # 6,
    python tests/gpu_check.py --parts b --budget b=540 --out /tmp/b    # 9 (all but bench's variable-length CLM)
    python tests/gpu_check.py --tiny --out /tmp/gpu_check      # the same code path on CPU, tiny sizes (~2 minutes)
    python tests/gpu_check.py --parts c --budget c=400 --out /tmp/c    # one part again, with more time

Four parts, in this order:
  a. correctness: tests/test_gpu.py under pytest; each test passed, failed or skipped, with why. Where torch has
     varlen_attn with window_size and CUDA is here, a skipped "varlen" backend fails the check.
  b. speed at the paper's shape: bench.py, ModernBERT-base, seq_len 8192, micro batch 4, bf16, ours eager and
     compiled against transformers' ModernBertForMaskedLM (same weights and batches, same run), MLM 30% and CLM,
     packed and variable-length batches: tokens/s, MFU, peak memory. One bench.py process per (batches, objective),
     train.py's shape (packed) first, so a part cut short by its time limit keeps what it finished.
  c. train.py as users run it, through its CLI: Base from scratch on the installed Python's docstrings (data.py,
     a BPE trained here: nothing downloaded) with ModernBERT's vocabulary size, seq_len 8192, 2 micro batches of
     4 per step, three phases of 4 steps (CLM -> MLM 30% -> MLM 15% decay), compiled, TORCH_LOGS=recompiles,
     graph_breaks. Whether it learns (its val MLM loss falls), steady step time and MFU per phase, compile time,
     graphs, recompiles, graph breaks, the time of a checkpoint and of an evaluation; then the resume: the
     phase-2-end checkpoint copied to a new out_dir, train.py run there and stopped by SIGTERM mid phase 3
     (exit 143), the same command again, and its losses against the uninterrupted run's (bit-identical on CPU,
     within bf16 noise on a GPU).
  d. memory: the largest micro_batch_size whose training step fits at seq_len 8192, Base and Large, MLM and CLM
     (eager; one process per size, OOM caught per probe).
--tiny runs every part at tiny sizes (the bench's tiny model, seq_len 64) so that the suite runs this file on CPU
(tests/test_gpu_check.py): on a GPU the only new thing is the GPU.

Time limits. Each part has a budget (BUDGETS, or --budget); time a part leaves unused goes to the next, so the
whole check ends within their sum (1460 s) plus the report and GRACE per part cut short. Every command runs in its
own process group and the whole group (bench's workers, pytest's train.py runs, inductor's compile workers) is
stopped at its part's deadline; the part records what finished and the next part runs. The budgets come from the
GPU runs (see BUDGETS); report.json has each part's real seconds.

Writes OUT/report.md (a table per part, then the issue's goals against the figures), OUT/report.json (all of it,
bench's rows included) and OUT/logs/ (each command's output). This process never imports torch: no CUDA context
of its own to take memory from part d. Nothing downloads (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE).
"""

import argparse
import json
import os
import platform
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
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
THIS = os.path.abspath(__file__)
GRACE = 10  # seconds a command cut short has to write what it finished (pytest: its junit file)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONUNBUFFERED": "1"}

# Seconds per part, from the GPU runs (H200, torch 2.11, 2026-11-26, results/h200-2026-11-26): inductor compiles
# a Base graph in 45-65 s there, and compiling is most of every part but d.
#   a: 189 s (second run); the third, with the gradient tests added (5 tiny compiles), was cut at 280 s in the
#      resume test, which took 53 s in the second;
#   b: one bench.py process per (batches, objective), each ours eager, ours compiled and transformers on Base at
#      4 x 8192: packed CLM 111 s, packed MLM 151 s, variable MLM 251 s (ours compiles 3 graphs as the lengths
#      vary), variable CLM not yet run (taken as long);
#   c: 231 and 280 s: data 12 s, the whole run 163 s (117 s of it compiling 2 graphs), 2 resumed runs of 48 and
#      57 s, compiling from inductor's cache;
#   d: 42 and 43 s for Base and Large, both objectives.
BUDGETS = {"a": 320, "b": 780, "c": 300, "d": 60}
SIZES = {  # what each part runs: the paper's shape, or tiny on CPU
    "full": dict(bench_size="base", seq_len=8192, micro=4, accum=2, bench_steps=5, phase_steps=4, eval_windows=8,
                 model_config={"vocab_size": 50368}, probe_sizes=["base", "large"], probe_cap=64),
    "tiny": dict(bench_size="tiny", seq_len=64, micro=2, accum=2, bench_steps=2, phase_steps=4, eval_windows=8,
                 model_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                                   local_attention=16), probe_sizes=["tiny"], probe_cap=4),
}


# -----------------------------------------------------------------------------
# Running commands: each in its own process group, its output in a log, killed with its group at the deadline


def run(cmd, log, deadline, env=None):
    """-> (exit code, None if the deadline came first; seconds). A line of the log every 30 s shows progress.
    At the deadline the group gets SIGINT, then SIGKILL GRACE seconds later."""
    shown = shlex.join(["python", *cmd[1:]] if cmd[0] == PY else cmd).replace(ROOT + os.sep, "")
    print(f"  $ {shown}", flush=True)
    started = last_shown = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**ENV, **(env or {})},
                             start_new_session=True)
        try:
            while p.poll() is None and time.time() < deadline:
                time.sleep(0.2)
                if time.time() - last_shown >= 30:
                    print(f"    {time.time() - started:.0f} s: {last_line(log)[:150]}", flush=True)
                    last_shown = time.time()
        finally:  # the deadline, or this check stopped (SIGTERM, Ctrl-C): nothing of the group outlives it
            code = p.poll()
            if code is None:  # SIGINT first: pytest then writes the junit file and output of the tests it finished
                os.killpg(p.pid, signal.SIGINT)
                try:
                    p.wait(GRACE)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    seconds = time.time() - started
    outcome = "timed out" if code is None else "done" if code == 0 else f"exit {code}"
    print(f"    {outcome} in {seconds:.0f} s, log: {log}", flush=True)
    return code, seconds


def last_line(path):
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 2000))
        lines = [x.strip() for x in re.split(r"[\r\n]", f.read().decode(errors="replace")) if x.strip()]
    return lines[-1] if lines else ""


def tail(path, n=2000):
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def said(log):
    """What the hooks of `--train` and the probes of `--probe` printed: one JSON object per 'gpu_check: ' line."""
    with open(log, errors="replace") as f:
        return [json.loads(m) for m in re.findall(r"gpu_check: (\{.*\})", f.read())]


# -----------------------------------------------------------------------------
# a. Correctness: tests/test_gpu.py


def correctness(ctx, deadline):
    log = os.path.join(ctx.logs, "a_pytest.log")
    code, tests = pytest_tests("tests/test_gpu.py", log, deadline)
    result = {**judge_tests(tests, ctx.env, timed_out=code is None), "tests": tests}
    if not tests and code is not None:  # not even collected: say why
        hint = " (carry tests/.kernels to the GPU: bash tests/install_kernels.sh makes it)" if "tests/.kernels" in \
            tail(log) else ""
        result.update(ok=False, summary=f"pytest exit {code}, no test ran{hint}: {last_line(log)[:200]}")
    return result


def pytest_tests(path, log, deadline):
    """-> (pytest's exit code, None if cut short; each test's outcome). One process, without pytest.ini's options
    (-n: pytest-xdist, which a GPU machine may lack). The junit file, written at the end or on the deadline's
    SIGINT, has each skip's reason and the differences the tests print; -vv's line per test as it ends names the
    one that was running when the deadline came, or all of them if pytest did not stop within GRACE."""
    junit = os.path.splitext(log)[0] + "_junit.xml"
    if os.path.exists(junit):
        os.remove(junit)
    code, _ = run([PY, "-m", "pytest", path, "-o", "addopts=", "-vv", "-rA", "-p", "no:cacheprovider",
                   "-o", "junit_logging=system-out", f"--junitxml={junit}"], log, deadline)
    tests = junit_tests(junit) if os.path.exists(junit) else []
    if code is None:
        named = {t["test"] for t in tests}
        tests += [t for t in verbose_tests(log) if t["test"] not in named]
    return code, tests


def junit_tests(path):
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped: an empty element
            continue
        outcome, detail = "passed", (case.findtext("system-out") or "").strip()
        for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                outcome, detail = name, case.find(tag).get("message") or ""
        tests.append(dict(test=case.get("name"), outcome=outcome, seconds=round(float(case.get("time") or 0), 1),
                          detail=" ".join(detail.split())[:300]))
    return tests


def verbose_tests(log):
    """The tests a cut-short pytest finished, from its -vv lines; the one it was running when killed."""
    with open(log, errors="replace") as f:
        text = f.read()
    tests = [dict(test=name, outcome=outcome.lower(), seconds=None, detail=reason or "") for name, outcome, reason in
             re.findall(r"^\S*test_gpu\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR)(?: \((.*)\))?", text, re.M)]
    running = re.findall(r"^\S*test_gpu\.py::(\S+) *$", text, re.M)
    tests += [dict(test=name, outcome="timeout", seconds=None, detail="running when the time limit came")
              for name in running[-1:]]
    return tests


def judge_tests(tests, env, timed_out):
    """The verdict of part a. A skipped varlen backend (or the 'none' stand-in when no kernel was found) fails it
    wherever this torch has varlen_attn with window_size on CUDA: it should have run."""
    varlen_due = env["cuda"] and env["varlen"]
    for t in tests:
        if varlen_due and t["outcome"] == "skipped" and re.search(r"\bvarlen\b|-none\]|\[none", t["test"]):
            t["outcome"], t["detail"] = "failed", "skipped, but this torch has varlen_attn with window_size: " + t[
                "detail"]
    count = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped", "timeout")}
    counts = ", ".join(f"{n} {k}" for k, n in count.items() if n)
    if varlen_due and not any("varlen" in t["test"] and t["outcome"] == "passed" for t in tests):
        count["failed"] += 1
        counts += "; no varlen test passed"
    if timed_out:
        return dict(ok=False, timeout=True, summary=f"cut short by the time limit: {counts or 'no test finished'}")
    if not env["cuda"] and tests and count["skipped"] == len(tests):
        return dict(ok=None, summary=f"no CUDA device: all {len(tests)} tests skip, so nothing is checked here")
    ok = bool(tests) and count["failed"] + count["error"] == 0
    return dict(ok=ok, summary=counts or "no test ran")


# -----------------------------------------------------------------------------
# b. Speed: bench.py, one process per (batches, objective)

BENCH = [("packed", "clm"), ("packed", "mlm"), ("variable", "mlm"), ("variable", "clm")]  # train.py packs: first


def speed(ctx, deadline):
    s, rows, runs, attention, peak = ctx.size, [], [], [], None
    for case, objective in BENCH:
        if time.time() >= deadline - 5:
            runs.append(dict(case=case, objective=objective, outcome="not run: the part's time was spent"))
            continue
        out = os.path.join(ctx.logs, f"b_{case}_{objective}.json")
        skip = ["loss", "data"] + (["attention"] if attention else [])  # the attention table once
        code, seconds = run([PY, "bench.py", "--size", s["bench_size"], "--seq_len", str(s["seq_len"]),
                             "--batch_size", str(s["micro"]), "--steps", str(s["bench_steps"]), "--warmup", "2",
                             "--cases", case, "--objectives", objective, "--skip", *skip, "--out", out],
                            os.path.join(ctx.logs, f"b_{case}_{objective}.log"), deadline)
        outcome = "timeout" if code is None else "done" if code == 0 else f"exit {code}"
        runs.append(dict(case=case, objective=objective, outcome=outcome, seconds=round(seconds)))
        if code == 0:
            with open(out) as f:
                bench = json.load(f)
            rows += bench["step"]
            attention = attention or bench.get("attention", [])
            peak = bench["peak_flops"]
    done = [r for r in runs if r["outcome"] == "done"]
    best = {}  # per (batches, objective): ours compiled where it ran, else ours eager
    for r in rows:
        if r["impl"] != "transformers" and (r["case"], r["objective"]) not in best or r["impl"] == "ours compiled":
            best[r["case"], r["objective"]] = r
    summary = f"{len(done)} of {len(BENCH)} (batches, objective) measured" + "".join(
        f"; {r['impl']} {c} {o}: MFU {r['MFU']}, {r['vs_transformers']} transformers" for (c, o), r in best.items())
    failed = any(r["outcome"].startswith("exit") for r in runs)
    return dict(ok=False if failed else len(done) == len(BENCH) or None, timeout=any(
        r["outcome"] in ("timeout", "not run: the part's time was spent") for r in runs),
                summary=summary, runs=runs, rows=rows, attention=attention, peak_flops=peak)


# -----------------------------------------------------------------------------
# c. train.py through its CLI: three phases, compiled, a checkpoint, SIGTERM, resume


def phases(n):
    return [dict(name="clm", objective="clm", steps=n, warmup_steps=1),
            dict(name="mlm", objective="mlm", mask_prob=0.3, steps=n),
            dict(name="decay", objective="mlm", mask_prob=0.15, steps=n, decay=True)]


def training(ctx, deadline):
    s, n = ctx.size, ctx.size["phase_steps"]
    data = os.path.join(ctx.work, "data")
    result = dict(ok=None, timeout=False)
    if not os.path.isfile(os.path.join(data, "meta.json")):  # the installed Python's docstrings: no download
        code, _ = run([PY, "data.py", "--demo", "general", "--tokenizer", "bpe:4096", "--out", data, "--val_docs",
                       "2000", "--workers", str(min(8, os.cpu_count() or 1))], os.path.join(ctx.logs, "c_data.log"),
                      deadline)
        if code != 0:
            return dict(result, ok=False, timeout=code is None, summary="data.py failed: see logs/c_data.log")
    args = [f"--data_dir={data}", "--init_from=scratch", "--model_size=base", f"--model_config={s['model_config']!r}",
            f"--seq_len={s['seq_len']}", f"--micro_batch_size={s['micro']}",
            f"--global_batch_size={s['micro'] * s['accum']}", f"--phases={phases(n)!r}", "--log_interval=1",
            "--eval_interval=1000000", f"--eval_windows={s['eval_windows']}", "--ckpt_interval=1000000",
            "--ckpt_every_minutes=0", "--compile=True"]
    # On CPU inductor builds C++ for minutes: tiny runs compile with aot_eager (dynamo's tracing and guards, the
    # same graphs, recompiles and breaks, without inductor); on CUDA with inductor.
    hooks = [] if ctx.env["cuda"] else ["--aot_eager"]
    torch_logs = {"TORCH_LOGS": "recompiles,graph_breaks"}

    # The whole run, uninterrupted: the figures, and the reference of the resumed run.
    whole, resumed = os.path.join(ctx.work, "c_whole"), os.path.join(ctx.work, "c_resumed")
    for d in (whole, resumed):
        shutil.rmtree(d, ignore_errors=True)
    log = os.path.join(ctx.logs, "c_whole.log")
    code, seconds = run([PY, THIS, "--train", *hooks, "--", *args, f"--out_dir={whole}"], log, deadline,
                        torch_logs)
    if code != 0:
        what = "timed out" if code is None else f"exited {code}"
        return dict(result, ok=False, timeout=code is None, summary=f"train.py {what} (logs/c_whole.log): "
                    f"{last_line(log)[:200]}")
    result.update(whole_run_seconds=round(seconds, 1), **run_figures(whole, log, s, ctx.results.get("b", {})),
                  learning=learning_figures(metrics(whole)))

    # The resume: from the checkpoint at the end of phase 2 (copied by hard links), SIGTERM mid phase 3, again.
    start, stop = 2 * n, 2 * n + n // 2
    os.makedirs(resumed)
    shutil.copytree(os.path.join(whole, f"ckpt-{start}"), os.path.join(resumed, f"ckpt-{start}"),
                    copy_function=hard_link)
    shutil.copy(os.path.join(whole, "metrics.jsonl"), resumed)  # train.py cuts it back to the step it resumes
    command = [PY, THIS, "--train", *hooks, "--", *args, f"--out_dir={resumed}"]
    first, second = os.path.join(ctx.logs, "c_resume_1.log"), os.path.join(ctx.logs, "c_resume_2.log")
    code1, _ = run(command[:3] + [f"--sigterm_at={stop}"] + command[3:], first, deadline, torch_logs)
    code2 = run(command, second, deadline, torch_logs)[0] if code1 == 143 else "not run"
    result["resume"] = resume_figures(whole, resumed, start, stop, first, second, code1, code2, ctx.env["cuda"])
    result["ok"] = result["learning"]["ok"] and result["resume"]["ok"] and result["graph_breaks"] in (0, None)
    result["timeout"] = None in (code1, code2)
    per_phase = "; ".join(f"{p['phase']} {p['steady_step_s']} s" for p in result["phases"])
    result["summary"] = (f"{result['learning']['summary']}; steady step {per_phase}; {result['graphs']} graphs, "
                         f"{result['recompiles']} recompiles, {result['graph_breaks']} graph breaks; "
                         f"resume: {result['resume']['summary']}")
    return result


def hard_link(src, dst):
    """A checkpoint is never written in place (new files, then a rename), so a link is as good as a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_figures(out_dir, log, s, bench):
    """Per phase: the first step (with its compile) and the steady steps, from metrics.jsonl (one record a step,
    evaluations and checkpoints left out of its time); the compile, checkpoint and evaluation figures of the hooks."""
    records, tokens_per_step = metrics(out_dir), s["micro"] * s["accum"] * s["seq_len"]
    packed = {(r["objective"], r["impl"]): r["MFU"] for r in bench.get("rows", []) if r["case"] == "packed"}
    bench_mfu = {o: packed.get((o, "ours compiled"), packed.get((o, "ours"), "-")) for o in ("clm", "mlm")}
    rows = []
    for phase in phases(s["phase_steps"]):
        mine = [r for r in records if r["phase"] == phase["name"] and "loss" in r]
        if not mine:
            continue
        steady = mine[1:] or mine  # the first step of a phase may compile
        step_s = [tokens_per_step / r["tokens_per_s"] for r in mine]
        mfu = [r["mfu"] for r in steady if "mfu" in r]
        rows.append(dict(phase=phase["name"], objective=phase["objective"] + (
            f" {phase['mask_prob']:.0%}" if phase["objective"] == "mlm" else ""), steps=len(mine),
            first_step_s=round(step_s[0], 3), steady_step_s=round(statistics.median(step_s[1:] or step_s), 3),
            tokens_per_s=round(statistics.median(r["tokens_per_s"] for r in steady)),
            mfu=f"{100 * statistics.median(mfu):.1f}%" if mfu else "-", bench_mfu=bench_mfu[phase["objective"]]))
    hooks = said(log)
    compiled = next((h for h in hooks if h["what"] == "compile"), {})
    with open(log, errors="replace") as f:
        text = f.read()
    checkpoints = [h for h in hooks if h["what"] == "checkpoint"]
    evaluations = [h["seconds"] for h in hooks if h["what"] == "evaluation"]
    return dict(phases=rows, compile_seconds=compiled.get("seconds"), graphs=compiled.get("graphs"),
                graph_breaks=compiled.get("graph_breaks"), recompiles=text.count("Recompiling function"),
                graph_break_lines=len(re.findall(r"Graph break", text)),
                recompile_reasons=re.findall(r"\[__recompiles\][ \t]+- \d+/\d+: ([^#\n]*?)[ \t]*(?:#|\n)", text)[:5],
                checkpoints=[dict(name=h["path"], seconds=round(h["seconds"], 2)) for h in checkpoints],
                evaluation_seconds=[round(x, 2) for x in evaluations],
                peak_memory=re.findall(r"peak memory ([\d.]+ GiB)", text)[-1:])


LEARNS = 0.002  # the least relative fall of the val MLM loss over the run: the tiny CPU run's is 0.7%


def learning_figures(records):
    """The run learns: its last evaluation's val MLM loss below its first's by LEARNS or more. Steps that leave
    the weights where they are still time well and resume bit-identically, so the other figures cannot say."""
    vals = [r["val_mlm_loss"] for r in records if "val_mlm_loss" in r]
    if len(vals) < 2:
        return dict(ok=False, fell=None, summary=f"{len(vals)} evaluation(s): cannot tell whether the run learns")
    fell = 1 - vals[-1] / vals[0]
    ok = fell >= LEARNS
    return dict(ok=ok, first=vals[0], last=vals[-1], fell=fell,
                summary=f"val MLM loss {vals[0]:.4f} -> {vals[-1]:.4f} ({-fell:+.2%}): "
                        f"{'it learns' if ok else 'it does NOT learn'} (a fall of {LEARNS:.1%} or more wanted)")


def resume_figures(whole, resumed, start, stop, first, second, code1, code2, cuda):
    """The resumed run continues the uninterrupted one: the same steps, the same losses (CPU: bit for bit; GPU:
    within 1%, the kernels' backward adds in a varying order)."""
    out = dict(ok=False, start=start, stop=stop, exit_on_sigterm=code1, exit_after=code2)
    with open(first, errors="replace") as f:
        text1 = f.read()
    out["stopped_by_sigterm"] = f"stopped by SIGTERM at step {stop}" in text1
    out["resumed_at"] = [int(x) for x in re.findall(r"resuming at step (\d+)", text1)]
    if None in (code1, code2):
        out["summary"] = "cut short by the time limit"
        return out
    if code1 != 143 or code2 != 0:
        out["summary"] = f"the resumed run exited {code1} on SIGTERM (want 143), then {code2} (want 0)"
        return out
    with open(second, errors="replace") as f:
        out["resumed_at"] += [int(x) for x in re.findall(r"resuming at step (\d+)", f.read())]
    a = {r["step"]: r for r in metrics(whole) if r["step"] > start}
    b = {r["step"]: r for r in metrics(resumed) if r["step"] > start}
    keys = ("loss", "val_mlm_loss", "val_clm_loss")
    diffs = [abs(a[k][key] - b[k][key]) / abs(a[k][key]) for k in a if k in b for key in keys if key in a[k]]
    out.update(steps_compared=sorted(set(a) & set(b)), same_steps=sorted(a) == sorted(b),
               max_rel_diff=max(diffs, default=None), identical=diffs != [] and max(diffs) == 0.0)
    tolerance = 0.01 if cuda else 0.0
    out["ok"] = (out["same_steps"] and out["stopped_by_sigterm"] and out["resumed_at"] == [start, stop]
                 and diffs != [] and max(diffs) <= tolerance)
    same = "bit-identical" if out["identical"] else f"max relative difference {out['max_rel_diff']:.2e}"
    want = "a GPU run must stay within 1%" if cuda else "a CPU run must be bit-identical"
    out["summary"] = (f"resumed at step {start} (phase-2 checkpoint), SIGTERM at step {stop} -> exit {code1}, "
                      f"resumed at {stop} -> exit {code2}; steps {start + 1}-{max(a)} against the uninterrupted run: "
                      f"{same} ({'ok' if out['ok'] else 'NOT ok'}: {want})")
    return out


# -----------------------------------------------------------------------------
# d. Memory: the largest micro batch that fits, per size and objective


def memory(ctx, deadline):
    s, rows, timeout = ctx.size, [], False
    for size in s["probe_sizes"]:
        spec = dict(size=size, seq_len=s["seq_len"], objectives=["mlm", "clm"], cap=s["probe_cap"])
        log = os.path.join(ctx.logs, f"d_{size}.log")
        code, _ = run([PY, THIS, "--probe", json.dumps(spec)], log, deadline)
        found = said(log)  # one line per objective as it is done: a cut-short process keeps the first
        rows += found
        for objective in spec["objectives"][len(found):]:
            rows.append(dict(size=size, objective=objective, largest="timeout" if code is None else f"exit {code}"))
        timeout = timeout or code is None
    summary = ", ".join(f"{r['size']} {r['objective']} {r['largest']}" for r in rows)
    return dict(ok=all(isinstance(r["largest"], int) for r in rows) or None, timeout=timeout, rows=rows,
                summary=f"largest micro_batch_size at seq_len {s['seq_len']}: {summary}")


# -----------------------------------------------------------------------------
# Workers: what runs in the subprocesses (these import torch, the check itself does not)


def env_worker(_):
    """The machine: versions, the GPU, which attention kernels this torch has."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    sys.path.insert(0, ROOT)
    from support import kernels
    from support.flops import peak_flops

    cuda = torch.cuda.is_available()
    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=cuda, cuda_version=torch.version.cuda,
                device="cpu", cpus=os.cpu_count(), varlen=kernels.find_varlen_attn() is not None,
                flash_attn=kernels.flash_attn_varlen_func is not None)
    for package in ("transformers", "triton"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2 ** 30, 1),
                    sms=props.multi_processor_count, peak_tflops=(peak_flops(torch.device("cuda")) or 0) / 1e12)
    # model.py's "auto" under bf16 autocast on this machine (bench.py's ours, train.py)
    info["attention"] = "flash" if cuda and info["flash_attn"] else "varlen" if cuda and info["varlen"] else "sdpa"
    print(json.dumps(info))


def train_worker(argv):
    """train.py exactly as `python train.py ARGS` runs it, with hooks that compute nothing of the run: they time
    each checkpoint and evaluation (train.py leaves both out of its step time and logs neither), print dynamo's
    counters at exit, and with --sigterm_at=K send this process SIGTERM at the end of step K: the signal a
    scheduler sends, at a step that is the same on every machine. --aot_eager: compile with dynamo's aot_eager."""
    hooks, args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    sigterm_at = next((int(a.split("=")[1]) for a in hooks if a.startswith("--sigterm_at=")), None)
    import atexit
    import functools
    import runpy
    from contextlib import contextmanager

    import torch
    sys.path.insert(0, ROOT)
    from support.checkpoint import Checkpointer
    from support.logger import Logger

    def say(what, **kw):
        os.write(2, f"\ngpu_check: {json.dumps(dict(what=what, **kw))}\n".encode())

    save, after_step, pause = Checkpointer.save, Checkpointer.after_step, Logger.pause

    def timed_save(self, path, *rest):
        started = time.time()
        save(self, path, *rest)
        say("checkpoint", path=os.path.basename(path), seconds=time.time() - started)

    @contextmanager
    def timed_pause(self):  # train.py's loop pauses the logger's clock for each evaluation, and only there
        with pause(self):
            started = time.time()
            yield
            say("evaluation", seconds=time.time() - started)

    def after_step_signalled(self, model, optimizer, state, *rest, **kw):
        if state.step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return after_step(self, model, optimizer, state, *rest, **kw)

    def counters_at_exit():
        from torch._dynamo.utils import compilation_time_metrics, counters
        say("compile", graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
            seconds=round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 1))

    Checkpointer.save, Checkpointer.after_step, Logger.pause = timed_save, after_step_signalled, timed_pause
    if "--aot_eager" in hooks:
        torch.compile = functools.partial(torch.compile, backend="aot_eager")
    atexit.register(counters_at_exit)
    sys.argv = [os.path.join(ROOT, "train.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")


def probe_worker(argv):
    """The largest micro batch of seq_len tokens each whose training step (forward, backward, fused AdamW, bf16
    autocast, train.py's dropout) fits, per objective: probes of one step each, a CUDA OOM caught, from a linear
    fit of the peaks of the probes that fit, then bisection. Eager: a compiled step keeps fewer activations."""
    import dataclasses
    import gc

    import numpy as np
    import torch
    sys.path.insert(0, ROOT)
    from bench import SIZES as BENCH_SIZES
    from bench import make_inputs, peak_memory, reset_peak_memory, sync
    from model import ModernBertForMaskedLM

    spec = json.loads(argv[0])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = dataclasses.replace(BENCH_SIZES[spec["size"]], attn_out_dropout=0.1)
    with device:  # built on the GPU: seconds less than on the CPU for Large
        model = ModernBertForMaskedLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if cuda else {}))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    rng = np.random.default_rng(0)

    def step(b, objective):
        x = make_inputs([spec["seq_len"]] * b, config.vocab_size, objective, device, rng)
        with autocast:
            loss = model(x["tokens"], causal=objective == "clm", cu_seqlens=x["cu"], max_seqlen=x["max_len"],
                         rows=x["rows"], targets=x["targets"]) / x["targets"].numel()
        loss.backward()
        optimizer.step()
        sync(device)

    def peak_of(b, objective):
        """Peak bytes of one step of b sequences, None if it does not fit."""
        before, started = reset_peak_memory(device), time.time()
        try:
            step(b, objective)
            peak = peak_memory(device, before)
        except torch.OutOfMemoryError:
            peak = None
        except RuntimeError as e:  # cuBLAS and some kernels report a failed allocation in their own words
            if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e) and "out of memory" not in str(e):
                raise
            peak = None
        optimizer.zero_grad(set_to_none=True)  # outside the except: its frames, holding the step's tensors, are gone
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        return peak, time.time() - started

    for objective in spec["objectives"]:
        fits, probes = 0, []  # the largest that fits; every (micro batch, peak or None, seconds)
        fails = spec["cap"] + 1
        b = 1
        while fits + 1 < fails and len(probes) < 12:
            peak, seconds = peak_of(b, objective)
            probes.append([b, peak, round(seconds, 2)])
            fits, fails = (b, fails) if peak is not None else (fits, b)
            ok = [(x, p) for x, p, _ in probes if p is not None]
            guess = 2 * fits  # doubling, until the linear fit below has two points
            if total and len(ok) >= 2:  # peak ~ fixed + per_sequence * b: the b that reaches 97% of the GPU
                (b1, p1), (b2, p2) = ok[-2], ok[-1]
                per_sequence = (p2 - p1) / (b2 - b1) if b2 != b1 else p2 / b2
                guess = int(b2 + (0.97 * total - p2) // max(per_sequence, 1))
            b = guess if fits < guess < fails else (fits + fails) // 2
        peak = next(p for x, p, _ in probes if x == fits) if fits else None
        row = dict(size=spec["size"], objective=objective, seq_len=spec["seq_len"], largest=fits,
                   capped=fits == spec["cap"], peak_gib=round(peak / 2 ** 30, 2) if peak else None,
                   total_gib=round(total / 2 ** 30, 1) if total else None, probes=probes)
        print(f"gpu_check: {json.dumps(row)}", flush=True)


# -----------------------------------------------------------------------------
# The report


def md_table(rows, columns):
    cells = [[r.get(c, "") for c in columns] for r in rows]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join("-" if v is None else str(v).replace("|", "/") for v in row) + " |" for row in cells]


def goals(results):
    """The issue's goals against this run's figures (meaningful on a GPU only; on CPU the rows still show)."""
    b, c = results["parts"].get("b", {}), results["parts"].get("c", {})
    rows = []
    pct = lambda text: float(text.rstrip("%x"))  # noqa: E731
    for r in b.get("rows", []):
        if r["impl"] == "ours compiled":
            rows.append(dict(goal=f"MFU >= 40%, compiled, {r['case']} {r['objective']}", measured=r["MFU"],
                             met=pct(r["MFU"]) >= 40))
            want = 1.3 if r["case"] == "variable" else 1.0
            rows.append(dict(goal=f"tokens/s >= {want}x transformers, {r['case']} {r['objective']}",
                             measured=r["vs_transformers"], met=pct(r["vs_transformers"]) >= want))
    if "learning" in c:
        fell = c["learning"]["fell"]
        rows.append(dict(goal=f"train.py's run learns: its val MLM loss falls {LEARNS:.1%} or more",
                         measured="-" if fell is None else f"{fell:.2%}", met=c["learning"]["ok"]))
    if "graph_breaks" in c:
        rows.append(dict(goal="0 graph breaks in train.py", measured=c["graph_breaks"], met=c["graph_breaks"] == 0))
        rows.append(dict(goal="one graph per mask, at most one recompile besides the mask's",
                         measured=f"{c['graphs']} graphs, {c['recompiles']} recompiles",
                         met=(c["graphs"] or 0) <= 3 and c["recompiles"] <= 2))
    if len(c.get("phases", [])) == 3:  # the decay runs the MLM phase's graph: its first step compiles nothing
        decay = c["phases"][2]
        rows.append(dict(goal="the phase switch compiles once: the decay's first step as its others (< 2x)",
                         measured=f"{decay['first_step_s']} s vs {decay['steady_step_s']} s",
                         met=decay["first_step_s"] < 2 * decay["steady_step_s"]))
    for p in c.get("phases", []):
        if p["mfu"] != "-" and p["bench_mfu"] != "-":
            rows.append(dict(goal=f"train.py MFU within 10% of bench's, {p['phase']}",
                             measured=f"{p['mfu']} vs {p['bench_mfu']}",
                             met=abs(pct(p["mfu"]) / pct(p["bench_mfu"]) - 1) <= 0.1))
    return rows


def write_report(out, results):
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    env, parts = results["env"], results["parts"]
    device = f"{env['device']} ({env.get('memory_gib', '-')} GiB)" if env["cuda"] else f"CPU ({env['cpus']} cores)"
    lines = [f"# GPU check: {device}, {results['date']}", "",
             f"`{results['command']}`: {results['mode']} sizes, {results['seconds']:.0f} s in all. torch "
             f"{env['torch']} (CUDA {env['cuda_version'] or 'none'}), Python {env['python']}, transformers "
             f"{env['transformers']}, triton {env['triton']}; flash-attn "
             f"{'installed' if env['flash_attn'] else 'absent'}, torch varlen_attn with window_size "
             f"{'present' if env['varlen'] else 'absent'}; attention 'auto' here: {env['attention']}.", "",
             *md_table([dict(part=k, title=TITLES[k], status=p["status"], seconds=f"{p['seconds']:.0f} / "
                             f"{p['limit']:.0f}", ok={True: "yes", False: "NO", None: "-"}[p.get("ok")],
                             summary=p.get("summary", "")) for k, p in parts.items()],
                       ["part", "title", "status", "seconds", "ok", "summary"]), ""]
    for key, part in parts.items():
        lines += [f"## {key}. {TITLES[key]}", "", part.get("summary", ""), ""]
        if part["status"] == "error":
            lines += ["```", part.get("error", "")[-1500:], "```", ""]
        if key == "a" and part.get("tests"):
            lines += md_table(part["tests"], ["test", "outcome", "seconds", "detail"])
        if key == "b":
            peak = part.get("peak_flops") or {}
            if peak:
                lines += [f"MFU over {peak['flops'] / 1e12:,.4g} TFLOP/s ({peak['source']}); attention of ours: "
                          f"{env['attention']}; memory: peak during the timed steps.", ""]
            lines += md_table(part.get("rows", []), ["case", "objective", "impl", "pad_%", "tok/s", "vs_transformers",
                                                     "MFU", "mem_MiB", "mem_vs_transformers", "compiles"])
            lines += ["", *md_table(part.get("runs", []), ["case", "objective", "outcome", "seconds"])]
            if part.get("attention"):
                lines += ["", "Attention alone, forward + backward:", "",
                          *md_table(part["attention"], ["backend", "dtype", "layer", "causal", "ms"])]
        if key == "c" and part.get("phases"):
            lines += md_table(part["phases"], ["phase", "objective", "steps", "first_step_s", "steady_step_s",
                                               "tokens_per_s", "mfu", "bench_mfu"])
            facts = [("whole run (s)", part["whole_run_seconds"]), ("dynamo compile time (s)", part["compile_seconds"]),
                     ("graphs compiled", part["graphs"]), ("recompiles (TORCH_LOGS)", part["recompiles"]),
                     ("graph breaks (counters / TORCH_LOGS lines)", f"{part['graph_breaks']} / "
                                                                    f"{part['graph_break_lines']}"),
                     ("recompile reasons", "; ".join(part["recompile_reasons"]) or "-"),
                     ("checkpoints (s)", ", ".join(f"{x['name']} {x['seconds']}" for x in part["checkpoints"])),
                     ("evaluations (s)", ", ".join(map(str, part["evaluation_seconds"]))),
                     ("peak memory", ", ".join(part["peak_memory"]) or "-"),
                     ("learning", part["learning"]["summary"]),
                     ("resume", part.get("resume", {}).get("summary", "not run"))]
            lines += ["", *md_table([dict(what=k, value=v) for k, v in facts], ["what", "value"])]
        if key == "d" and part.get("rows"):
            lines += md_table(part["rows"], ["size", "objective", "largest", "capped", "peak_gib", "total_gib"])
            lines += ["", "One eager training step as train.py's (bf16 autocast on a GPU, fused AdamW, its dropout); "
                      "a compiled step keeps fewer activations, so these fit under torch.compile too."]
        lines.append("")
    met = [dict(r, met="yes" if r["met"] else "NO") for r in goals(results)]
    lines += ["## Goals (issue 40)", "", "On a GPU, ours compiled against the goals; on CPU the rows show that the "
              "check computes them.", "", *md_table(met, ["goal", "measured", "met"]), ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))


# -----------------------------------------------------------------------------
# The check

TITLES = {"a": "Correctness: tests/test_gpu.py", "b": "Speed: bench.py at the paper's shape",
          "c": "train.py through its CLI: 3 phases, checkpoint, SIGTERM, resume",
          "d": "Memory: the largest micro_batch_size"}
PARTS = {"a": correctness, "b": speed, "c": training, "d": memory}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the folder for report.md, report.json and logs/")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the whole check on CPU in about two minutes")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--budget", nargs="+", default=[], metavar="PART=SECONDS", help="e.g. b=300 (defaults: "
                   + ", ".join(f"{k}={v}" for k, v in BUDGETS.items()) + ")")
    p.add_argument("--work", help="scratch for data and checkpoints (default: a temporary folder, removed at the end)")
    args = p.parse_args(argv)
    budgets = dict(BUDGETS)
    for item in args.budget:
        key, _, seconds = item.partition("=")
        if key not in PARTS or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--budget {item}: write PART=SECONDS with PART one of {', '.join(PARTS)}")
        budgets[key] = float(seconds)
    return args, budgets


def main(argv=None):
    args, budgets = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: run()'s finally kills the running group
    started = time.time()
    out, logs = args.out, os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    env_log = os.path.join(logs, "env.log")
    if run([PY, THIS, "--env"], env_log, time.time() + 120)[0] != 0:
        raise SystemExit(f"could not read the machine's torch and GPU:\n{tail(env_log)}")
    env = json.loads(last_line(env_log))
    if not env["cuda"] and not args.tiny:
        raise SystemExit("no CUDA device here: the full check is for a GPU (Base at 8192 tokens would take hours on "
                         "CPU); --tiny runs the same parts at tiny sizes")
    print(f"{env['device']}, torch {env['torch']}, attention {env['attention']}; parts {' '.join(args.parts)}, "
          f"budgets {', '.join(f'{k} {budgets[k]:.0f} s' for k in args.parts)}", flush=True)
    results = dict(command=shlex.join(["python", "tests/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
                   date=time.strftime("%Y-%m-%d %H:%M"), mode="tiny" if args.tiny else "full", env=env,
                   budgets=budgets, parts={})
    work = args.work or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(work, exist_ok=True)
    ctx = SimpleNamespace(logs=logs, work=work, env=env, size=SIZES["tiny" if args.tiny else "full"],
                          results=results["parts"])
    spare = 0.0  # seconds the parts before left unused
    try:
        for key in args.parts:
            limit = budgets[key] + spare
            print(f"\n{key}. {TITLES[key]} (limit {limit:.0f} s)", flush=True)
            t0 = time.time()
            try:
                part = PARTS[key](ctx, t0 + limit)
                part["status"] = "timeout" if part.pop("timeout", False) else "done"
            except Exception as e:  # noqa: BLE001 (one part's bug must not cost the others their run)
                part = dict(status="error", ok=False, summary=f"{type(e).__name__}: {e}", error=traceback.format_exc())
                print(part["error"], flush=True)
            part.update(seconds=time.time() - t0, limit=limit)
            spare = max(0.0, limit - part["seconds"])
            results["parts"][key] = part
            print(f"  -> {part['status']}: {part.get('summary', '')}", flush=True)
            results["seconds"] = time.time() - started
            write_report(out, results)  # after every part: a check stopped from outside still leaves a report
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nwrote {os.path.join(out, 'report.md')} ({results['seconds']:.0f} s)")


WORKERS = {"--env": env_worker, "--train": train_worker, "--probe": probe_worker}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in WORKERS:
        WORKERS[sys.argv[1]](sys.argv[2:])
    else:
        main()
