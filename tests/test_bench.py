"""bench.py runs at a tiny size and reports every section."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")


def test_bench_tiny(tmp_path):
    pytest.importorskip("transformers")
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(f"document {i} " + "word " * (i % 37) for i in range(400)))
    args = ["--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--steps", "2", "--warmup", "1",
            "--loss_runs", "1", "--loss_seq_len", "32", "--loss_vocab", "1024", "--out", str(tmp_path / "bench.json"),
            "--profile", str(tmp_path / "prof")]
    tokenizer = os.path.join(SHARED, "tokenizers", "modernbert", "tokenizer.json")
    if os.path.isfile(tokenizer):  # the data section needs a real tokenizer.json
        args += ["--lengths_from", str(text), "--tokenizer", tokenizer]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "1. Training step" in r.stdout and "2. Attention" in r.stdout and "3. LM loss memory" in r.stdout
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {(row["case"], row["objective"], row["impl"]) for row in res["step"]} == {  # no compile on CPU by default
        (c, o, i) for c in ("variable", "packed") for o in ("mlm", "clm") for i in ("ours", "transformers")}
    for row in res["step"]:
        assert row["raw"]["tokens_per_s"] > 0 and row["raw"]["flops_per_s"] > 0 and row["raw"]["peak_memory"] >= 0
    for case, objective in [(c, o) for c in ("variable", "packed") for o in ("mlm", "clm")]:  # one step each, by op
        profile = (tmp_path / "prof" / f"profile_{case}_{objective}.txt").read_text()
        assert profile.startswith(f"ours, {case} {objective}, one step of ") and "aten::mm" in profile
    assert any(row["backend"] == "sdpa" for row in res["attention"])
    full, chunked = res["loss_memory"]
    assert (full["loss"], chunked["loss"]) == ("full_logits", "chunked")
    assert abs(full["loss_sum"] - chunked["loss_sum"]) <= 1e-4 * full["loss_sum"]  # the same loss, both ways
    if os.path.isfile(tokenizer):
        assert "4. Data" in r.stdout and res["data"]["prepare_1_workers_tokens_per_s"] > 0


def test_the_sections_that_run_alone(tmp_path):
    """freeze and finetune_memory, small: their rows, and the micro batches --max_tokens cuts the paper's 16 examples
    into (share, minutes of train.py runs beside busy processes, is not run here)."""
    def run(*args):
        r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args, "--out", str(tmp_path / "b.json")],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return json.loads((tmp_path / "b.json").read_text())

    rows = run("freeze", "--steps", "1", "--warmup", "0")["freeze"]
    assert [(r["frozen"], r["vs_none"]) for r in rows][0] == ("none", "1.000") and rows[1]["frozen"] == "0-7"
    rows = run("finetune_memory", "--size", "tiny", "--seq_len", "32", "--max_tokens", "100")["finetune_memory"]
    assert [r["micro_batches"] for r in rows] == [6, 1]  # 3 examples of 32 tokens at a time, then all 16 at once
