"""bench.py runs at a tiny size and reports every section; a failed worker loses no other row."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_tiny(tmp_path):
    pytest.importorskip("transformers")
    args = ["--size", "tiny", "--seq_len", "64", "--batch_size", "2", "--min_time", "0.02", "--warmup", "1",
            "--largest", "2", "--out", str(tmp_path / "bench.json"), "--profile", str(tmp_path / "prof")]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "1. Training step" in r.stdout and "2. Attention" in r.stdout and "3. The largest" in r.stdout
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {(row["case"], row["objective"], row["impl"]) for row in res["step"]} == {  # no compile on CPU by default
        (c, o, i) for c in ("variable", "packed") for o in ("mlm", "clm") for i in ("ours", "transformers")}
    for row in res["step"]:
        assert row["raw"]["tokens_per_s"] > 0 and row["raw"]["flops_per_s"] > 0 and row["raw"]["peak_memory"] >= 0
        assert float(row["MFU_6N"].rstrip("%")) > 0 and row["raw"]["warmup_seconds"] > 0
    for case, objective in [(c, o) for c in ("variable", "packed") for o in ("mlm", "clm")]:  # one step each, by op
        profile = (tmp_path / "prof" / f"profile_{case}_{objective}.txt").read_text()
        assert profile.startswith(f"ours, {case} {objective}, one step of ") and "aten::mm" in profile
    cells = {(a["case"], a["layer"], a["causal"]): {} for a in res["attention"]}
    for a in res["attention"]:
        cells[a["case"], a["layer"], a["causal"]][a["backend"]] = a
    assert len(cells) == 8  # (packed, variable) x (global, local) x (bidirectional, causal)
    for row in cells.values():
        assert set(row) == {"varlen", "flash", "cudnn", "flex", "sdpa"}
        for needs_cuda in ("varlen", "flash", "cudnn"):  # listed, skipped, saying why
            assert "needs CUDA" in row[needs_cuda]["note"] and "fwd_ms" not in row[needs_cuda]
        assert float(row["sdpa"]["err"]) <= 1e-5 and float(row["sdpa"]["grad_err"]) <= 1e-5
        assert float(row["flex"]["err"]) <= 1e-5 and row["flex"]["note"] == "forward only: no backward on CPU"
    assert [(row["objective"], row["largest"], row["capped"]) for row in res["largest"]] == [
        ("mlm", 2, True), ("clm", 2, True)]  # on CPU nothing runs out of memory: the cap is the answer


def test_a_failed_worker_loses_no_other_row(tmp_path):
    """Two attention backends for ours in one run (--attn_backends), one of which cannot run here: its row is
    reported failed, with the worker's reason, the other measured and written, and the exit status is 1."""
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--size", "tiny", "--seq_len", "64",
                        "--batch_size", "2", "--min_time", "0.02", "--warmup", "1", "--cases", "packed",
                        "--objectives", "mlm", "--impls", "ours", "--attn_backends", "sdpa", "global=cudnn,local=sdpa",
                        "--skip", "attention", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1 and "'cudnn' (SDPA's cuDNN kernel) needs CUDA" in r.stderr
    assert "failed (their errors above): packed mlm ours [global=cudnn,local=sdpa]" in r.stderr
    rows = json.loads(out.read_text())["step"]
    assert [row["impl"] for row in rows] == ["ours [sdpa]"] and rows[0]["raw"]["tokens_per_s"] > 0
