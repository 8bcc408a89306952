"""support/suite.py and eval.py --suite: the paired interval against a hand-computed example and scipy, the nested
interval over both seed levels by hand, the power against a simulation of the design, the suite file, and end to
end on slices of two real tasks (../shared/data) with two tiny models: the table equals eval.py run per task, a
killed suite resumes without repeating a run, a broken task fails before training,
torchrun equals one process. Exports conll_slice and jsonl_slice to test_baselines.py."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import eval
from support import suite
from model import ModernBertConfig, ModernBertForMaskedLM
from test_train import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")
TOKENIZER = os.path.join(ROOT, "..", "shared", "tokenizers", "modernbert", "tokenizer.json")
needs_shared = pytest.mark.skipif(not (os.path.isdir(DATA) and os.path.isfile(TOKENIZER)),
                                  reason="../shared (data and tokenizers) is not beside the checkout")


def test_paired_interval_hand_computed_and_against_scipy():
    # d = (1, 2, 3): 2 ± t_{0.975, 2} / sqrt(3) = 2 ± 2.484138; unpaired, the seeds' spread (70 to 93) would swamp it
    d = suite.paired_delta([70.0, 80.0, 90.0], [71.0, 82.0, 93.0])
    assert d["n"] == 3 and d["mean"] == pytest.approx(2.0)
    assert (d["low"], d["high"]) == pytest.approx((2 - 2.484138, 2 + 2.484138), abs=1e-6)
    assert suite.paired_delta([0.5], [0.7]) == {"mean": pytest.approx(0.2), "low": None, "high": None, "n": 1}
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for n in (2, 5, 9, 40):
        a, noise = rng.normal(0.8, 0.05, n), rng.normal(0.01, 0.02, n)
        ci, d = stats.ttest_rel(a + noise, a).confidence_interval(0.95), suite.paired_delta(a, a + noise)
        assert (d["low"], d["high"]) == pytest.approx((ci.low, ci.high), abs=1e-6)


def test_nested_interval_hand_computed():
    """3 pretraining seeds x 2 fine-tuning seeds. d = arm - base = [[1, 2], [2, -1], [-1, 2]]: D_s = 1.5, 0.5, 0.5,
    mean 5/6, sd(D_s) = sqrt(1/3), half-width t_{0.975, 2} sqrt(1/3) / sqrt(3) = 4.302653 / 3; within = the mean of
    the rows' variances (0.5, 4.5, 4.5) = 19/6, so the fine-tuning seeds alone give Var(D_s) >= 19/12, more than the
    D_s's 1/3: between = 0 and the spread is sqrt(19/12); 4 of 6 paired runs above 0."""
    base, arm = [[70, 72], [68, 71], [75, 73]], [[71, 74], [70, 70], [74, 75]]
    d = suite.nested_delta(base, arm)
    assert d["mean"] == pytest.approx(5 / 6) and d["per_pretraining_seed"] == pytest.approx([1.5, 0.5, 0.5])
    assert (d["low"], d["high"]) == pytest.approx((5 / 6 - 4.302653 / 3, 5 / 6 + 4.302653 / 3), abs=1e-6)
    assert d["within"] == pytest.approx(19 / 6) and d["between"] == 0 and d["spread"] == pytest.approx((19 / 12) ** .5)
    assert d["signs"] == {"seeds": [3, 0], "runs": [4, 2]} and d["finetune_seeds"] == 2
    # Pretraining seeds far apart: D_s = 0.1, 3.1, 6.1 (variance 9), within 0.02: between 8.99, the spread the D_s's 3
    wide = suite.nested_delta([[0, 0], [0, 0], [0, 0]], [[0, 0.2], [3, 3.2], [6, 6.2]])
    assert (wide["between"], wide["spread"]) == pytest.approx((8.99, 3.0))
    # One pretraining seed: its fine-tuning seeds say nothing of the pretraining seeds' noise, so no interval
    one = suite.nested_delta([[70, 72, 71]], [[71, 74, 70]])
    assert one["mean"] == pytest.approx(2 / 3) and one["low"] is one["detectable"] is one["between"] is None
    # The spread with 4 fine-tuning seeds: between 1, within 2 -> sqrt(1 + 2/4); none from one pretraining seed
    assert suite.design_sd({"between": 1.0, "within": 2.0, "finetune_seeds": 2}, 4) == pytest.approx(1.5 ** 0.5)
    assert suite.design_sd(one, 5) is None


def test_power_against_a_simulation_of_the_design():
    """The difference found with 80% power, by the noncentral t, against draws of per-seed differences: the share
    of their 95% intervals that exclude 0. A true difference of the interval's half-width is found ~61% of the time
    with 3 seeds (the H200 study's), which is why the half-width is not the design's resolution."""
    rng = np.random.default_rng(0)

    def found(delta, n, sd=1.0, draws=20000):
        d = rng.normal(delta, sd, (draws, n))
        half = stats.t.ppf(0.975, n - 1) * d.std(axis=1, ddof=1) / np.sqrt(n)
        return float((np.abs(d.mean(axis=1)) > half).mean())

    stats = pytest.importorskip("scipy.stats")
    for n in (3, 5, 9):
        delta = suite.detectable(1.0, n)
        assert suite.power(1.0, n, delta) == pytest.approx(0.8, abs=1e-9)
        assert found(delta, n) == pytest.approx(0.8, abs=0.012)  # 20,000 draws: sd of the share 0.003
    half = stats.t.ppf(0.975, 2) / np.sqrt(3)  # the half-width at sd 1, 3 seeds
    assert suite.power(1.0, 3, half) == pytest.approx(0.61, abs=0.01) and found(half, 3) == pytest.approx(0.61, abs=0.012)
    assert suite.detectable(1.0, 3) / half == pytest.approx(1.31, abs=0.01)
    # The fewest seeds: below them the power is short of 80%, at them it is not
    n = suite.seeds_needed(0.5, 0.5)  # sd 0.5
    assert suite.power(0.5, n - 1, 0.5) < 0.8 <= suite.power(0.5, n, 0.5) and found(0.5, n, 0.5) >= 0.79


def test_suite_files_model_names_stored_runs_and_options(tmp_path, capsys):
    (tmp_path / "s.py").write_text("seeds = [1, 2]\ntasks = [dict(name='n', task='ner', data='tasks/n'),\n"
                                   "         dict(name='c', task='cls', data='/abs/c', lr=1e-4, epochs=3)]\n")
    seeds, tasks = suite.load_suite(str(tmp_path / "s.py"))
    assert seeds == [1, 2]
    assert tasks[0] == dict(name="n", task="ner", data=str(tmp_path / "tasks" / "n"), epochs=20, lr=5e-5,
                            batch_size=16, max_len=None, max_tokens=None, warmup_ratio=0.0, weight_decay=0.01,
                            pooling="mean", select="macro_f1")
    assert tasks[1]["data"] == "/abs/c" and tasks[1]["lr"] == 1e-4 and tasks[1]["epochs"] == 3
    for task, said in (("task='ner', data='x', learning_rate=1", r"unknown key\(s\) \['learning_rate'\].*lr"),
                       ("task='tagging', data='x'", "task='tagging'")):
        (tmp_path / "bad.py").write_text(f"seeds = [1]\ntasks = [dict(name='n', {task})]\n")
        with pytest.raises(SystemExit, match=said):
            suite.load_suite(str(tmp_path / "bad.py"))

    seeds, tasks = suite.load_suite(os.path.join(ROOT, "suites", "en_bio.py"))  # the paper's
    assert len(seeds) == 5 and len(tasks) == 11
    types = {t["name"]: t["task"] for t in tasks}
    assert types["ncbi_disease"] == types["anatem"] == types["bc5cdr"] == types["jnlpba"] == "ner"
    assert types["gad"] == types["chemprot"] == "cls" and types["hoc"] == types["phenotype"] == "multilabel"
    assert all(t["epochs"] == (20 if t["task"] == "ner" else 10) and t["lr"] == 5e-5 and t["batch_size"] == 16
               for t in tasks)
    seeds, tasks = suite.load_suite(os.path.join(ROOT, "suites", "fr_bio.py"))
    assert seeds == list(range(42, 51)) and len(tasks) == 8

    assert suite.model_names(["out/en_base/final", "out/en_base_mlm/final"]) == ["en_base/final", "en_base_mlm/final"]
    assert suite.model_names(["x/a/final", "y/a/final"]) == ["x/a/final", "y/a/final"]
    with pytest.raises(SystemExit, match="given twice"):
        suite.model_names(["out/a/final", "out/a/final/"])

    # a run stored under an older protocol is not a finished run of today's
    old = dict(lr=5e-5, batch_size=16, max_len=512, warmup_ratio=0.1, weight_decay=0.01, pooling="mean", seed=1)
    now = {**old, "max_len": 8192, "warmup_ratio": 0.0, "max_tokens": 4096, "select": "macro_f1"}
    suite.store_run(str(tmp_path / "seed1.json"), old, {"test": {}})
    done, stale = suite.finished_runs([(str(tmp_path / "seed1.json"), now)])
    assert done == {} and len(stale) == 1
    assert "max_len=512, max_tokens=None, select=None, warmup_ratio=0.1; now max_len=8192, max_tokens=4096" in stale[0]

    with pytest.raises(SystemExit):  # the file's settings, not silently dropped ones from the command line
        eval.main(["--suite", os.path.join(ROOT, "suites", "en_bio.py"), "--models", "a", "b", "--epochs", "3",
                   "--seeds", "1"])
    err = capsys.readouterr().err
    assert "--seeds, --epochs would be ignored" in err and "en_bio.py" in err


# -----------------------------------------------------------------------------
# End to end on slices of the shared tasks: 2 tasks x 2 tiny models x 2 seeds


def conll_slice(src, dst, n):
    """The first n sentences that mention an entity: something a tiny model can learn from in 2 epochs."""
    sentences = [s for s in open(src, encoding="utf-8").read().split("\n\n") if "\tB-" in s][:n]
    dst.write_text("\n\n".join(sentences) + "\n", encoding="utf-8")


def jsonl_slice(src, dst, n):
    """n lines, half of each label."""
    rows = [json.loads(line) for line in open(src, encoding="utf-8")]
    picked = [r for label in ("0", "1") for r in [r for r in rows if r["label"] == label][:n // 2]]
    dst.write_text("".join(json.dumps(r) + "\n" for r in picked), encoding="utf-8")


# Data paths are relative to the suite file, which the fixture writes beside the slices.
# gad: 128 tokens per micro batch, two to four sentences: several micro batches on each of two ranks.
TASKS = ['dict(name="ncbi_disease", task="ner", data="ncbi_disease", epochs=2, lr=5e-3, max_len=128)',
         'dict(name="gad", task="cls", data="gad", epochs=2, lr=5e-3, max_len=128, max_tokens=128)']


def suite_text(tasks):
    return "seeds = [1, 2]\ntasks = [\n    " + ",\n    ".join(tasks) + ",\n]\n"


def run_suite_cmd(tmp, out, suite_file="suite.py", models="ab"):
    return [os.path.join(ROOT, "eval.py"), "--suite", str(tmp / suite_file), "--models",
            *[str(tmp / m / "final") for m in models], "--out", str(out), "--device", "cpu"]


def results(out):
    return json.loads((out / "results.json").read_text())


def table_row(out, task):
    return next(line for line in (out / "results.md").read_text().splitlines() if line.startswith(f"| {task} "))


@pytest.fixture(scope="module")
def shared_suite(tmp_path_factory):
    """Slices of two shared tasks, two tiny random models with the ModernBERT tokenizer (out/a/final
    and out/b/final: the same basename), one uninterrupted run of the suite, and gad_only.py: its last task."""
    tmp = tmp_path_factory.mktemp("suite")
    for task in ("ncbi_disease", "gad"):
        (tmp / task).mkdir()
        for split, n in (("train", 48), ("devel", 16), ("test", 16)):
            if task == "gad":
                jsonl_slice(os.path.join(DATA, task, f"{split}.jsonl"), tmp / task / f"{split}.jsonl", n)
            else:
                conll_slice(os.path.join(DATA, task, f"{split}.tsv"), tmp / task / f"{split}.tsv", n)
    for seed, name in enumerate("ab"):
        torch.manual_seed(seed)  # hidden 32 and 2 layers: the 50368-token embedding stays small
        ModernBertForMaskedLM(ModernBertConfig(vocab_size=50368, hidden_size=32, intermediate_size=48,
                                               num_hidden_layers=2, num_attention_heads=2, local_attention=64)
                              ).save_pretrained(tmp / name / "final")
        shutil.copyfile(TOKENIZER, tmp / name / "final" / "tokenizer.json")
    (tmp / "suite.py").write_text(suite_text(TASKS))
    (tmp / "gad_only.py").write_text(suite_text(TASKS[1:]))
    eval.main(run_suite_cmd(tmp, tmp / "out")[1:])
    return tmp


@needs_shared
def test_suite_table_equals_eval_per_task(shared_suite):
    tmp = shared_suite
    res = results(tmp / "out")
    assert list(res["tasks"]) == ["ncbi_disease", "gad"] and list(res["models"]) == ["a/final", "b/final"]
    # eval.py's single-task command gives the same numbers (one NER and the cls task; the second seed)
    for task, kind, model, budget in (("ncbi_disease", "ner", "a", "4096"), ("gad", "cls", "b", "128")):
        eval.main(["--model", str(tmp / model / "final"), "--task", kind, "--data", str(tmp / task), "--seeds", "2",
                   "--epochs", "2", "--lr", "5e-3", "--max_len", "128", "--max_tokens", budget, "--device", "cpu",
                   "--out", str(tmp / f"single_{task}")])
        single = results(tmp / f"single_{task}")["runs"]
        row = res["tasks"][task]["models"][f"{model}/final"]
        upstream = "weighted_f1" if kind == "cls" else "micro_f1"
        assert row["macro_f1"]["per_seed"][1:] == [r["test"]["macro_f1"] for r in single]
        assert row[upstream]["per_seed"][1:] == [r["test"][upstream] for r in single]
    stats = pytest.importorskip("scipy.stats")
    a_avg, b_avg = (np.mean([t["models"][m]["macro_f1"]["per_seed"] for t in res["tasks"].values()], axis=0)
                    for m in ("a/final", "b/final"))
    average = res["average"]["b/final"]["macro_f1"]
    assert (average["mean"], average["std"]) == pytest.approx((b_avg.mean(), np.std(b_avg, ddof=1)))
    for a, b, d in [(a_avg, b_avg, res["average"]["b/final"]["delta_macro_f1"])] + [
            (t["models"]["a/final"]["macro_f1"]["per_seed"], t["models"]["b/final"]["macro_f1"]["per_seed"],
             t["models"]["b/final"]["delta_macro_f1"]) for t in res["tasks"].values()]:
        assert d["mean"] == pytest.approx(np.mean(np.subtract(b, a)), abs=1e-12)
        if np.ptp(np.subtract(b, a)) > 0:  # scipy gives no interval for a constant difference
            ci = stats.ttest_rel(b, a).confidence_interval(0.95)
            assert (d["low"], d["high"]) == pytest.approx((ci.low, ci.high), abs=1e-5)

    md = (tmp / "out" / "results.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| task")]
    assert [r.split("|")[1].split()[0] for r in rows] == ["ncbi_disease", "gad", "**average**"]
    assert all(re.search(r"\| [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]( \*)? \|$", r) for r in rows)


@needs_shared
def test_killed_suite_resumes_without_repeating_a_run(shared_suite, tmp_path, capsys):
    tmp, out = shared_suite, tmp_path / "out"
    cmd = run_suite_cmd(tmp, out, suite_file="gad_only.py")  # 2 models x 2 seeds
    p = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while not list(out.glob("runs/*/*/*/seed*.json")) and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGSTOP)  # paused, not finished, while the same suite is started again: refused
    with pytest.raises(SystemExit, match=f"^--out={re.escape(str(out))} is in use by pid {p.pid} on "):
        eval.main(cmd[1:])
    os.kill(p.pid, signal.SIGKILL)  # as hard as a kill gets: no handler, no clean-up
    p.wait()
    first = {f: f.stat().st_mtime_ns for f in out.glob("runs/*/*/*/seed*.json")}
    assert 1 <= len(first) < 4, "the suite was not killed mid-run"

    capsys.readouterr()
    eval.main(cmd[1:])
    stdout = capsys.readouterr().out
    assert f"{len(first)} finished earlier, {4 - len(first)} to run" in stdout
    assert len(re.findall(r"^run \S+ / \S+ / seed \d+:", stdout, re.M)) == 4 - len(first)
    assert all(f.stat().st_mtime_ns == t for f, t in first.items())  # finished runs are not touched
    assert len(list(out.glob("runs/*/*/*/seed*.json"))) == 4
    # the table's row as the uninterrupted suite's: every seed's numbers, the paired delta
    assert results(out)["tasks"]["gad"] == results(tmp / "out")["tasks"]["gad"]
    assert table_row(out, "gad") == table_row(tmp / "out", "gad")


@needs_shared
def test_broken_tasks_and_changed_settings_are_refused_before_any_training(shared_suite, tmp_path):
    tmp = shared_suite
    for task, src in (("no_test", "gad"), ("unknown_label", "ncbi_disease"), ("unreadable", "gad")):
        shutil.copytree(tmp / src, tmp_path / task)
    os.remove(tmp_path / "no_test" / "test.jsonl")
    with open(tmp_path / "unknown_label" / "test.tsv", "a") as f:
        f.write("\naspirin\tB-Chemical\n")
    (tmp_path / "unreadable" / "devel.jsonl").write_bytes(b"\xff\xfe\x00 not text")
    broken = [f'dict(name="{t}", task="{k}", data="{tmp_path / t}", epochs=2)'
              for t, k in (("no_test", "cls"), ("unknown_label", "ner"), ("unreadable", "cls"))]
    (tmp / "broken.py").write_text(suite_text(TASKS + broken))
    with pytest.raises(SystemExit) as e:
        eval.main(run_suite_cmd(tmp, tmp_path / "out", suite_file="broken.py")[1:])
    message = str(e.value)
    assert "nothing was trained" in message
    assert re.search(r"task 'no_test': .*no test split", message)
    assert re.search(r"task 'unknown_label': .*test.tsv: example \d+ has label\(s\) \['B-Chemical'\]", message)
    assert re.search(r"task 'unreadable': .*devel.jsonl: cannot read it", message)
    assert not (tmp_path / "out").exists()  # the good tasks before them did not start either

    shutil.copytree(tmp / "out" / "runs", tmp_path / "out" / "runs")  # stored runs of other settings: kept, unused
    (tmp / "changed.py").write_text(suite_text(TASKS[:1] + [TASKS[1].replace("lr=5e-3", "lr=1e-3")]))
    before = {f: f.read_bytes() for f in (tmp_path / "out").rglob("*.json")}
    with pytest.raises(SystemExit) as e:
        eval.main(run_suite_cmd(tmp, tmp_path / "out", suite_file="changed.py")[1:])
    message = str(e.value)
    assert "4 stored run(s) cannot be reused" in message and "Delete them" in message
    assert message.count("lr=0.005; now lr=0.001") == 4 and "runs/gad/b/final/seed2.json" in message
    assert {f: f.read_bytes() for f in (tmp_path / "out").rglob("*.json")} == before


@needs_shared
def test_suite_under_torchrun_skips_alike_and_equals_one_process(shared_suite, tmp_path):
    # several micro batches per rank (only the last all-reduces); a ModernBERT run imports no transformers
    tmp, out, run = shared_suite, tmp_path / "out", os.path.join("runs", "gad", "a", "final")
    (out / run).mkdir(parents=True)  # seed 1 finished: rank 0 skips it, so must rank 1
    shutil.copyfile(tmp / "out" / run / "seed1.json", out / run / "seed1.json")
    r = subprocess.run([*launcher(2), *run_suite_cmd(tmp, out, suite_file="gad_only.py", models="a")], cwd=ROOT,
                       capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "1 finished earlier, 1 to run" in r.stdout
    imported = re.findall(r"^import time:.*\| +(\S+)$", r.stderr, re.M)
    assert "torch" in imported and not any(m.split(".")[0] == "transformers" for m in imported)
    one, two = (results(d)["tasks"]["gad"]["models"]["a/final"] for d in (tmp / "out", out))
    assert two["ran_with"] == {"max_len": 128, "max_tokens": 128}
    for metric in ("macro_f1", "weighted_f1"):  # seed 2 ran on two processes, seed 1 on one
        assert two[metric]["per_seed"] == pytest.approx(one[metric]["per_seed"], abs=1e-9)
    # every step's loss (6 steps), each the mean over the whole batch, both ranks' shares
    first, both = (json.loads((d / run / "seed2.json").read_text())["result"]["first_losses"]
                   for d in (tmp / "out", out))
    assert len(first) == 6 and len(set(first)) == 6 and all(abs(a / b - 1) < 1e-5 for a, b in zip(both, first))
