"""tests/gpu_check.py, the GPU check, runs end to end on CPU at tiny sizes: on a lent GPU the only new thing is the
GPU. Also: a part cut short by its time limit is recorded and the next part still runs; a skipped varlen backend
fails part a where torch has varlen_attn with window_size on CUDA (a case only a GPU shows, judged here)."""

import json
import os
import subprocess
import sys
import time

import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(out, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_check.py"), "--tiny", "--out", str(out),
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out / "report.json") as f:
        return json.load(f), (out / "report.md").read_text(), r.stdout


def test_the_check_runs_every_part_on_cpu(tmp_path):
    report, md, stdout = check(tmp_path / "check", "--budget", "a=120", "b=240", "c=240", "d=120")  # a busy CPU
    parts = report["parts"]
    assert {k: p["status"] for k, p in parts.items()} == dict.fromkeys("abcd", "done"), stdout[-3000:]
    # a: every test of tests/test_gpu.py listed, all skipped without CUDA, and the report says so
    assert parts["a"]["tests"] and {t["outcome"] for t in parts["a"]["tests"]} == {"skipped"}
    assert parts["a"]["ok"] is None and "no CUDA device" in parts["a"]["summary"]
    # b: bench.py's rows for both batches and objectives, ours against transformers
    assert {(r["case"], r["objective"], r["impl"]) for r in parts["b"]["rows"]} == {
        (c, o, i) for c in ("packed", "variable") for o in ("mlm", "clm") for i in ("ours", "transformers")}
    # c: the three phases timed; aot_eager: one graph per mask, the flip its one recompile, no break; 4 checkpoints
    # (3 phase ends and final) and 3 evaluations timed; the resumed run bit-identical to the uninterrupted one
    c = parts["c"]
    assert [(p["phase"], p["steps"]) for p in c["phases"]] == [("clm", 4), ("mlm", 4), ("decay", 4)]
    assert all(p["steady_step_s"] > 0 for p in c["phases"])
    assert (c["graphs"], c["recompiles"], c["graph_breaks"]) == (2, 1, 0)
    assert c["recompile_reasons"] == ["causal == True"]
    assert [x["name"] for x in c["checkpoints"]] == ["ckpt-4", "ckpt-8", "ckpt-12", "final"]
    assert len(c["evaluation_seconds"]) == 3
    assert c["learning"]["ok"] and c["learning"]["fell"] > gpu_check.LEARNS
    resume = c["resume"]
    assert resume["ok"] and resume["identical"] and resume["resumed_at"] == [8, 10] and resume["exit_on_sigterm"] == 143
    assert resume["steps_compared"] == [9, 10, 11, 12]
    # d: the probe's path: on CPU nothing runs out of memory, so the cap is the answer
    assert [(r["size"], r["objective"], r["largest"], r["capped"]) for r in parts["d"]["rows"]] == [
        ("tiny", "mlm", 4, True), ("tiny", "clm", 4, True)]
    for title in ("## a. Correctness", "## b. Speed", "## c. train.py", "## d. Memory", "## Goals"):
        assert title in md
    assert {"a_pytest.log", "b_packed_clm.log", "c_whole.log", "c_resume_2.log", "d_tiny.log"} <= set(
        os.listdir(tmp_path / "check" / "logs"))


def test_a_part_cut_short_is_recorded_and_the_next_part_runs(tmp_path):
    report, md, _ = check(tmp_path / "check", "--parts", "a", "d", "--budget", "a=1")
    a, d = report["parts"]["a"], report["parts"]["d"]
    assert a["status"] == "timeout" and a["ok"] is False and "cut short" in a["summary"]
    assert d["status"] == "done" and d["limit"] == gpu_check.BUDGETS["d"]  # a spent all of its second
    assert "| a | Correctness" in md and "timeout" in md


GPU_ENV = dict(cuda=True, varlen=True)


def junit(tmp_path, cases):
    path = tmp_path / "junit.xml"
    body = "".join(f'<testcase name="{name}" time="1.5">{inner}</testcase>' for name, inner in cases)
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    return gpu_check.junit_tests(str(path))


def test_a_skipped_varlen_fails_where_torch_has_varlen_on_cuda(tmp_path):
    passed = [("test_kernel_against_sdpa[16-True-False-varlen]", "<system-out>varlen: 1e-3</system-out>"),
              ("test_train_steps_with_each_backend[sdpa]", "")]
    ok = gpu_check.judge_tests(junit(tmp_path, passed), GPU_ENV, timed_out=False)
    assert ok["ok"] and ok["summary"] == "2 passed"
    skipped = [("test_kernel_against_sdpa[16-True-False-none]", '<skipped message="no GPU attention kernel here"/>'),
               ("test_train_steps_with_each_backend[sdpa]", "")]
    tests = junit(tmp_path, skipped)
    bad = gpu_check.judge_tests(tests, GPU_ENV, timed_out=False)
    assert bad["ok"] is False and "no varlen test passed" in bad["summary"]
    assert tests[0]["outcome"] == "failed" and "has varlen_attn" in tests[0]["detail"]
    # the same skip where this torch has no varlen_attn with window_size is only a skip
    assert gpu_check.judge_tests(junit(tmp_path, skipped), dict(cuda=True, varlen=False), timed_out=False)["ok"]


def test_a_cut_short_pytest_is_read_from_its_verbose_lines(tmp_path):
    log = tmp_path / "a_pytest.log"
    log.write_text("collected 11 items\n\n"
                   "tests/test_gpu.py::test_kernel_against_sdpa[16-True-False-varlen] PASSED  [  9%]\n"
                   "tests/test_gpu.py::test_sdpa_bf16_against_float32 FAILED  [ 18%]\n"
                   "tests/test_gpu.py::test_train_steps_with_each_backend[varlen] ")  # killed while it ran
    tests = gpu_check.verbose_tests(str(log))
    assert [(t["test"], t["outcome"]) for t in tests] == [
        ("test_kernel_against_sdpa[16-True-False-varlen]", "passed"), ("test_sdpa_bf16_against_float32", "failed"),
        ("test_train_steps_with_each_backend[varlen]", "timeout")]
    verdict = gpu_check.judge_tests(tests, GPU_ENV, timed_out=True)
    assert verdict["ok"] is False and verdict["summary"] == "cut short by the time limit: 1 passed, 1 failed, 1 timeout"


def test_a_cut_short_pytest_keeps_what_its_finished_tests_printed(tmp_path):
    """At the deadline pytest gets SIGINT and writes its junit file: the tests that finished keep their printed
    figures, and the one it was running is a timeout."""
    (tmp_path / "test_gpu.py").write_text("import time\n\ndef test_done():\n    print('max rel diff 1.5e-03')\n\n"
                                          "def test_slow():\n    time.sleep(600)\n")
    started = time.time()
    code, tests = gpu_check.pytest_tests(str(tmp_path / "test_gpu.py"), str(tmp_path / "a_pytest.log"), started + 20)
    assert code is None and time.time() - started < 20 + gpu_check.GRACE
    assert [(t["test"], t["outcome"]) for t in tests] == [("test_done", "passed"), ("test_slow", "timeout")]
    assert "max rel diff 1.5e-03" in tests[0]["detail"]


def test_the_goals_read_bench_rows_and_train_mfu():
    """Only a GPU run has compiled bench rows and a logged MFU: their reading is checked here."""
    bench = [dict(case=c, objective="mlm", impl="ours compiled", MFU=mfu, vs_transformers=ratio)
             for c, mfu, ratio in (("packed", "41.0%", "0.95x"), ("variable", "38.5%", "1.42x"))]
    train = dict(graphs=2, recompiles=2, graph_breaks=0, phases=[
        dict(phase=name, mfu="39.0%", bench_mfu="41.0%", first_step_s=first, steady_step_s=0.5)
        for name, first in (("clm", 40.0), ("mlm", 20.0), ("decay", 0.6))])
    rows = gpu_check.goals(dict(parts=dict(b=dict(rows=bench), c=train)))
    assert [(r["goal"], r["met"]) for r in rows] == [
        ("MFU >= 40%, compiled, packed mlm", True), ("tokens/s >= 1.0x transformers, packed mlm", False),
        ("MFU >= 40%, compiled, variable mlm", False), ("tokens/s >= 1.3x transformers, variable mlm", True),
        ("0 graph breaks in train.py", True), ("one graph per mask, at most one recompile besides the mask's", True),
        ("the phase switch compiles once: the decay's first step as its others (< 2x)", True)] + [
        (f"train.py MFU within 10% of bench's, {name}", True) for name in ("clm", "mlm", "decay")]


def test_a_run_whose_val_loss_stays_put_does_not_learn():
    """The H200 runs of 2026-11-26 (compiled, 12 steps of Base at 65k tokens): their steps timed well and resumed
    bit-identically, but their val MLM loss did not move; the tiny CPU run's falls by 0.7%."""
    def records(vals):
        return [dict(step=1, loss=11.0)] + [dict(step=s, loss=10.9, val_mlm_loss=v) for s, v in zip((4, 8, 12), vals)]

    flat = gpu_check.learning_figures(records([10.9121, 10.9122, 10.9121]))
    assert flat["ok"] is False and "does NOT learn" in flat["summary"]
    assert gpu_check.learning_figures(records([8.3170, 8.2791, 8.2569]))["ok"]
    assert gpu_check.learning_figures(records([8.3170]))["ok"] is False  # one evaluation cannot tell
    rows = gpu_check.goals(dict(parts=dict(c=dict(learning=flat))))
    assert [(r["goal"], r["met"]) for r in rows] == [("train.py's run learns: its val MLM loss falls 0.2% or more",
                                                      False)]
