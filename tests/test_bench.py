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
    for row in res["step"]:
        assert float(row["MFU_6N"].rstrip("%")) > 0 and row["raw"]["warmup_seconds"] > 0
    cells = {(a["case"], a["layer"], a["causal"]): {} for a in res["attention"]}
    for a in res["attention"]:
        cells[a["case"], a["layer"], a["causal"]][a["backend"]] = a
    assert len(cells) == 8  # (packed, variable) x (global, local) x (bidirectional, causal)
    for (case, layer, _), row in cells.items():
        assert set(row) == {"varlen", "flash", "cudnn", "sdpa-flash", "flex", "sdpa"}
        for needs_cuda in ("varlen", "flash", "cudnn"):  # listed, skipped, saying why
            assert "needs CUDA" in row[needs_cuda]["note"] and "fwd_ms" not in row[needs_cuda]
        assert float(row["sdpa"]["err"]) <= 1e-5 and float(row["sdpa"]["grad_err"]) <= 1e-5
        assert float(row["flex"]["err"]) <= 1e-5 and row["flex"]["note"] == "forward only: no backward on CPU"
        if case == "packed" and layer == "global":  # SDPA's flash kernel: no mask, so only there
            assert float(row["sdpa-flash"]["err"]) <= 1e-5 and float(row["sdpa-flash"]["grad_err"]) <= 1e-5
        else:
            assert row["sdpa-flash"]["note"].startswith("takes no mask")
    full, chunked = res["loss_memory"]
    assert (full["loss"], chunked["loss"]) == ("full_logits", "chunked")
    assert abs(full["loss_sum"] - chunked["loss_sum"]) <= 1e-4 * full["loss_sum"]  # the same loss, both ways
    if os.path.isfile(tokenizer):
        assert "4. Data" in r.stdout and res["data"]["prepare_1_workers_tokens_per_s"] > 0


def test_a_failed_worker_loses_no_other_row(tmp_path):
    """Two attention backends for ours in one run (--attn_backends), one of which cannot run here: its row is
    reported failed, with the worker's reason, the other measured and written, and the exit status is 1."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--size", "tiny", "--seq_len", "64",
                        "--batch_size", "2", "--steps", "1", "--warmup", "1", "--cases", "packed", "--objectives",
                        "mlm", "--impls", "ours", "--attn_backends", "sdpa", "global=cudnn,local=sdpa", "--skip",
                        "attention", "loss", "data", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and "'cudnn' (SDPA's cuDNN kernel) needs CUDA" in r.stderr
    assert "failed (their errors above): packed mlm ours [global=cudnn,local=sdpa]" in r.stderr
    rows = json.loads(out.read_text())["step"]
    assert [row["impl"] for row in rows] == ["ours [sdpa]"] and rows[0]["raw"]["tokens_per_s"] > 0


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
