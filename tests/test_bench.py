"""bench.py runs at a tiny size and reports every section; a failed worker loses no other row. tests/gpu_check.py,
the GPU check, runs end to end on CPU at tiny sizes: on a lent GPU the only new thing is the GPU. A part cut short by
its time limit is recorded and the next part still runs; a pytest cut short keeps what the tests it finished printed."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import bench
import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--min_time", "0.02", "--warmup", "1"]


def test_bench_tiny(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers' threads
    bench.main([*TINY, "--out", str(tmp_path / "bench.json"), "--profile", str(tmp_path / "prof")])  # --largest: part d
    out = capsys.readouterr().out
    assert "1. Training step" in out and "2. Attention" in out and "3. The largest" not in out
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {(row["case"], row["objective"], row["impl"]) for row in res["step"]} == {  # no compile on CPU by default
        (c, o, i) for c in ("variable", "packed") for o in ("mlm", "clm") for i in ("ours", "transformers")} | {
        ("task", "finetune", "ours")}  # eval.py's step: ours alone
    for row in res["step"]:
        assert row["raw"]["tokens_per_s"] > 0 and row["raw"]["flops_per_s"] > 0 and row["raw"]["peak_memory"] >= 0
        assert float(row["MFU_6N"].rstrip("%")) > 0 and row["raw"]["warmup_seconds"] > 0
    # fine-tuning: 16 sentences of 8 to seq_len tokens a step, its tok/s over the packed MLM row's (the first packed)
    rows = {(row["case"], row["objective"], row["impl"]): row for row in res["step"]}
    finetune, packed = rows["task", "finetune", "ours"], rows["packed", "mlm", "ours"]["raw"]
    assert 16 * 8 <= finetune["raw"]["tokens"] <= 16 * 64 and "task finetune: eval.py's step" in out
    assert float(finetune["vs_training"].rstrip("x")) == pytest.approx(
        finetune["raw"]["tokens_per_s"] / packed["tokens_per_s"], abs=0.006)
    assert {row["vs_training"] for row in res["step"] if row is not finetune} == {"-"}
    for case, objective in [(c, o) for c in ("variable", "packed") for o in ("mlm", "clm")]:  # one step each, by op
        profile = (tmp_path / "prof" / f"profile_{case}_{objective}.txt").read_text()
        assert profile.startswith(f"ours, {case} {objective}, one step of ") and "aten::mm" in profile
    cells = {(a["case"], a["layer"], a["causal"]): {} for a in res["attention"]}
    for a in res["attention"]:
        cells[a["case"], a["layer"], a["causal"]][a["backend"]] = a
    assert len(cells) == 8  # (packed, variable) x (global, local) x (bidirectional, causal)
    for row in cells.values():
        assert set(row) == {"varlen", "flash", "cudnn", "sdpa"}
        for needs_cuda in ("varlen", "flash", "cudnn"):  # listed, skipped, saying why
            assert "needs CUDA" in row[needs_cuda]["note"] and "fwd_ms" not in row[needs_cuda]
        assert float(row["sdpa"]["err"]) <= 1e-5 and float(row["sdpa"]["grad_err"]) <= 1e-5


def test_a_failed_worker_loses_no_other_row(tmp_path, capsys, monkeypatch):
    """Two attention backends for ours in one run (--attn_backends), one of which cannot run here: its row is
    reported failed, with the worker's reason, the other measured and written, and the run ends in that error."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit, match=r"workers failed \(their errors above\): packed mlm ours \[global=cudnn,"
                                         r"local=sdpa\]$"):
        bench.main([*TINY, "--cases", "packed", "--objectives", "mlm", "--impls", "ours", "--attn_backends", "sdpa",
                    "global=cudnn,local=sdpa", "--skip", "attention", "--out", str(out)])
    assert "'cudnn' (SDPA's cuDNN kernel) needs CUDA" in capsys.readouterr().err
    rows = json.loads(out.read_text())["step"]
    assert [row["impl"] for row in rows] == ["ours [sdpa]"] and rows[0]["raw"]["tokens_per_s"] > 0


def test_the_check_runs_every_part_on_cpu(tmp_path):
    out = tmp_path / "check"
    budgets = ["a=1", "b=600", "c=600", "d=300", "e=600", "f=600", "g=600", "h=600"]  # generous: a busy CPU
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_check.py"), "--tiny", "--out", str(out),
                        "--budget", *budgets], cwd=ROOT, capture_output=True, text=True, timeout=3000,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    parts, md = json.loads((out / "report.json").read_text())["parts"], (out / "report.md").read_text()
    # a: its 1 s spent before pytest could start: recorded as cut short; b then runs with its own 600 s
    assert parts["a"]["status"] == "timeout" and parts["a"]["ok"] is False and "cut short" in parts["a"]["summary"]
    assert 600 <= parts["b"]["limit"] < 601
    assert {k: p["status"] for k, p in parts.items()} == dict(a="timeout", **dict.fromkeys("bcdefgh", "done")), r.stdout
    # b: bench.py's rows, ours against transformers; tiny: one process, train.py's packed CLM (test_bench.py: all)
    assert [(r["case"], r["objective"], r["impl"]) for r in parts["b"]["rows"]] == [
        ("packed", "clm", "ours"), ("packed", "clm", "transformers")]
    # c: the phases timed; aot_eager compiles one graph per mask, the flip its one recompile, the decay nothing;
    # train.py's end line counts 3 evaluations (the phase ends) and 4 checkpoints (those and final); the resume
    # under torchrun, SIGTERM'd mid decay, continues the uninterrupted run bit for bit
    c = parts["c"]
    assert [(p["phase"], p["steps"]) for p in c["phases"]] == [("clm", 4), ("mlm", 4), ("decay", 60)]
    assert [p["compile_s"] > 0 for p in c["phases"]] == [True, True, False] and c["said"]["compile_s"] > 0
    assert c["learning"]["ok"] and c["learning"]["fell"] > 0.002
    said = dict(graphs=2, graph_breaks=0, recompiles=1, recompile_reasons="causal == True", evaluations=3,
                checkpoints=4)
    assert {k: c["said"][k] for k in said} == said
    assert [(x["run"], x["fx_graph hits"] + x["fx_graph misses"]) for x in c["caches"]] == [  # aot_eager: no inductor
        ("c_whole.log", 0), ("c_resume_1.log", 0), ("c_resume_2.log", 0)]
    resume = c["resume"]
    assert resume["wrote_final"] and resume["ok"] and resume["max_rel_diff"] == 0 and resume["exit_after"] == 0, resume
    assert resume["exit_on_sigterm"] != 0 and len(resume["stopped_at"]) == 1 and 8 < resume["stopped_at"][0] < 68
    assert resume["resumed_at"] == [8, *resume["stopped_at"]] and resume["steps"] == list(range(9, 69))
    # d: bench.py --largest: on CPU nothing runs out of memory, so the cap is the answer
    assert [(r["size"], r["objective"], r["largest"], r["capped"]) for r in parts["d"]["rows"]] == [
        ("tiny", "mlm", 4, True), ("tiny", "clm", 4, True)]
    # e: eval.py on each task type as one process, under torchrun and in float32 on CPU; cka.py --pair and --runs
    # on "the GPU" (CPU here) against CPU: every comparison of CPU with CPU identical; the demo not at tiny sizes
    steps = {s["step"]: s for s in parts["e"]["steps"]}
    assert [s["ok"] for s in steps.values()] == ["yes"] * 6 + ["-"], steps
    assert all(f"{task}: test macro F1" in steps[f"eval.py, {name}"]["figures"] for name in ("one", "torchrun", "cpu")
               for task in ("cls", "multilabel", "ner")), steps
    assert steps["eval.py: under torchrun and on CPU against one process"]["figures"] == (
        "test_scores: 0.00e+00; first_losses: 0.00e+00; first_losses_against_cpu_float32: 0.00e+00")
    assert all(steps[f"cka.py --{w}: GPU against CPU"]["figures"].startswith("max_abs_diff: 0.00e+00; numbers_compared")
               for w in ("pair", "runs"))
    # f: ours compiled whole (profiled), by regions from an empty cache, then from that cache; each attention kernel
    # (cuDNN's needs CUDA); Liger-Kernel's pieces where it is installed
    f = parts["f"]
    assert [(x["run"], x["objective"], x["impl"]) for x in f["rows"]] == [
        ("f_packed_clm", "clm", "ours compiled"), ("f_regions", "clm", "ours regional"),
        ("f_regions_warm", "clm", "ours regional")]
    cold, warm = (float(x["warmup_s"]) for x in f["rows"][1:])
    assert warm < cold / 2, f["rows"]
    assert "packed clm, one step of 128 tokens" in (out / "logs" / "profile_packed_clm.txt").read_text()
    assert {(x["layer"], x["causal"], x["backend"]) for x in f["attention"]} == {
        (layer, causal, kernel) for layer in ("global", "local") for causal in (False, True)
        for kernel in ("varlen", "cudnn", "sdpa")}
    assert all("needs CUDA" in x["note"] for x in f["attention"] if x["backend"] == "cudnn")
    assert "| note | fwd_ms | fwd_TFLOP/s |" in md  # the first row has a note only: the table has every row's columns
    assert "global causal" in f["summary"] and "local bidirectional" in f["summary"]
    if importlib.util.find_spec("liger_kernel"):
        assert [x["piece"] for x in f["liger"]] == ["norm + residual", "GeGLU", "RoPE (q, k)", "loss, CLM rows",
                                                    "loss, MLM rows (30%)"]
    else:
        assert f["liger"] == [] and "liger_kernel is not installed" in f["summary"]
    # g, h: ours compiled against transformers compiled, each row's ratio its tokens/s over transformers'
    for key, run_name, shape in (("g", "g_packed_clm", "2 x 64"), ("h", "h_short_clm", "16 x 8")):
        rows = parts[key]["rows"]
        assert [(x["run"], x["shape"], x["impl"]) for x in rows] == [
            (run_name, shape, "ours compiled"), (run_name, shape, "transformers compiled")]
        ratio = rows[0]["raw"]["tokens_per_s"] / rows[1]["raw"]["tokens_per_s"]
        assert rows[0]["vs_transformers"] == f"{ratio:.2f}x"
        assert f"of 1 rows: {run_name[2:]} {shape} {ratio:.2f}x" in parts[key]["summary"]
    for title in ("## a. Correctness", "## b. Speed", "## c. train.py", "## d. Memory", "## e. eval.py",
                  "## f. The step at the ceiling", "## g. Against transformers compiled", "## h. Against"):
        assert title in md
    assert {"b_packed_clm.log", "c_whole.log", "c_resume_2.log", "d_tiny.json", "e_eval_torchrun.log",
            "e_cka_runs_cpu.log", "f_regions_warm.log", "f_attention.json", "g_packed_clm.json",
            "h_short_clm.json"} <= set(os.listdir(out / "logs"))


def test_the_caches_table_reads_what_torch_logs(tmp_path):
    """caches() on a resumed train.py's lines, as torch 2.13 logged them (TORCH_LOGS as the check sets it) before
    compile_model let AOTAutograd's cache take the chunked loss: two FX graph hits, AOTAutograd bypassed; and the
    reason torch 2.11 gave under torchrun on an H200 (DDP's graph), with the quote in it."""
    at = "I1127 14:43:17.312000 16224 site-packages/torch/_functorch/_aot_autograd/autograd_cache.py:1077] [0/0] "
    (tmp_path / "c_resume_2.log").write_text(
        f"{at}Bypassing autograd cache due to: Unsupported call_function target autograd_function_apply. \n"
        f"{at} Function module: torch.ops.higher_order, \n"
        f"[rank0]:{at}Bypassing autograd cache due to: Won't cache a graph with fakify_first_call enabled\n" + "".join(
            "I1127 14:43:25.065000 16224 site-packages/torch/_inductor/codecache.py:2299] [0/0] fx graph cache hit for "
            f"key {key}\n" for key in ("faul7yq5xcnhnw6oz6647", "faeble2zp7qetn5wp6yev")) + "decay mlm step 15/68\n")
    assert gpu_check.caches(str(tmp_path / "c_resume_2.log")) == {
        "run": "c_resume_2.log", "fx_graph hits": 2, "fx_graph misses": 0, "fx_graph bypassed": 0,
        "aot_autograd hits": 0, "aot_autograd misses": 0, "aot_autograd bypassed": 2, "why": "Unsupported "
        "call_function target autograd_function_apply.; Won't cache a graph with fakify_first_call enabled"}


def test_a_cut_short_pytest_keeps_what_its_finished_tests_printed(tmp_path):
    """At the deadline pytest gets SIGINT and writes its junit file: the tests that finished keep their printed
    figures; the one it was running is left out. Also when the check ignores SIGINT (started with `nohup ... &`)."""
    (tmp_path / "test_gpu.py").write_text("import time\n\ndef test_done():\n    print('max rel diff 1.5e-03')\n\n"
                                          "def test_slow():\n    time.sleep(600)\n")
    started, ignored = time.time(), signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job is
    try:
        code, tests = gpu_check.pytest_tests(str(tmp_path / "test_gpu.py"), str(tmp_path / "a.log"), started + 15)
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert code is None and time.time() - started < 300  # cut at its deadline, not after the second's 600 s
    assert [(t["test"], t["outcome"]) for t in tests] == [("test_done", "passed")]
    assert "max rel diff 1.5e-03" in tests[0]["detail"]
