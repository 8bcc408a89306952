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
            "--out", str(tmp_path / "bench.json")]
    tokenizer = os.path.join(SHARED, "tokenizers", "modernbert", "tokenizer.json")
    if os.path.isfile(tokenizer):  # the data section needs a real tokenizer.json
        args += ["--lengths_from", str(text), "--tokenizer", tokenizer]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "1. Training step" in r.stdout and "2. Attention" in r.stdout
    res = json.loads((tmp_path / "bench.json").read_text())
    assert {(row["case"], row["objective"]) for row in res["step"]} == {
        (c, o) for c in ("variable", "packed") for o in ("mlm", "clm")}
    for row in res["step"]:
        for impl in ("ours", "transformers"):
            assert row[f"{impl}_raw"]["tokens_per_s"] > 0 and row[f"{impl}_raw"]["peak_memory"] >= 0
    assert any(row["backend"] == "sdpa" for row in res["attention"])
    if os.path.isfile(tokenizer):
        assert "4. Data" in r.stdout and res["data"]["prepare_1_workers_tokens_per_s"] > 0
