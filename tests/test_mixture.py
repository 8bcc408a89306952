"""data.py's weighted mixtures (`--input A B --weights 0.7 0.3 --tokens N`), checked on what train.bin and
val.bin hold, not on data.py's own bookkeeping: the two sources are written in disjoint alphabets, so every
document read back from the shards says which source it came from and which of its documents it is."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from data import plan_mixture, split_val_docs
from support.tokenizer import load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = [sys.executable, os.path.join(ROOT, "data.py")]


def texts(letters, n, seed):
    """n distinct documents of 4-40 words over the given letters."""
    rng, out = random.Random(seed), set()
    while len(out) < n:
        out.add(" ".join("".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(rng.randint(4, 40))))
    return sorted(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Source A, 'small': 60 documents over a-h; source B, 'large': 600 over s-z; a BPE trained on both."""
    d = tmp_path_factory.mktemp("mixture")
    small, large = texts("abcdefgh", 60, 0), texts("stuvwxyz", 600, 1)
    (d / "small.txt").write_text("\n".join(small) + "\n")
    (d / "large.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in large))
    train_bpe(iter(small + large), 400, str(d / "tok.json"))
    tok = load_tokenizer(str(d / "tok.json"))
    small_tokens = sum(len(ids) + 1 for ids in tok.encode_batch(small))  # with eos, as in the shards
    return d, small, large, small_tokens


def read_docs(out, split):
    """The documents of out/split.bin as texts, in file order, and their lengths in tokens (eos included)."""
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(str(out))
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
    assert ids[-1] == tok.eos_id
    docs = np.split(ids, np.flatnonzero(ids == tok.eos_id)[:-1] + 1)
    return [tok.decode(d[:-1].tolist()) for d in docs], [len(d) for d in docs]


def source_of(text, small, large):
    """'A' or 'B', from the text's alphabet; and the text must be one whole document of that source."""
    letters = set(text) - {" "}
    if letters <= set("abcdefgh"):
        assert text in small, f"not a whole document of A: {text[:60]!r}"
        return "A"
    assert letters <= set("stuvwxyz"), f"a document mixing both sources: {text[:60]!r}"
    assert text in large, f"not a whole document of B: {text[:60]!r}"
    return "B"


def run_data(cwd, *args):
    r = subprocess.run(DATA + list(args), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_mixture_shares_counted_in_train_bin(corpus):
    d, small, large, small_tokens = corpus
    budget = 3 * small_tokens  # A's 70% is 2.1x all of A (more after its validation documents): A must repeat
    stdout = run_data(d, "--input", "small.txt", "large.jsonl", "--weights", "0.7", "0.3", "--tokens", str(budget),
                      "--tokenizer", "tok.json", "--out", "mix", "--val_docs", "10", "--workers", "1")
    train, lengths = read_docs(d / "mix", "train")
    labels = [source_of(t, set(small), set(large)) for t in train]
    total = sum(lengths)
    shares = {s: sum(n for n, x in zip(lengths, labels) if x == s) / total for s in "AB"}
    print(f"\nmixture 0.7/0.3 of {budget:,} tokens: train.bin holds {total:,} tokens, "
          f"A {shares['A']:.2%}, B {shares['B']:.2%}")
    assert abs(total - budget) / budget < 0.02
    assert abs(shares["A"] - 0.7) < 0.02 and abs(shares["B"] - 0.3) < 0.02

    # A is repeated as whole documents: each of its training documents 2 or 3 times; B is sampled, once each.
    val, _ = read_docs(d / "mix", "val")
    count = {t: train.count(t) for t in set(train)}
    a_train = [t for t in small if t not in val]
    assert all(count.get(t, 0) in (2, 3) for t in a_train), sorted({count.get(t, 0) for t in a_train})
    assert max(count[t] for t, x in zip(train, labels) if x == "B") == 1
    assert len({t for t, x in zip(train, labels) if x == "B"}) < len(large) // 2  # a part of B

    # Interleaved, not one source after the other: both sources in every tenth of the file, and about as
    # many runs of one source as a random order gives (2 nA nB / n).
    for k in range(10):
        assert set(labels[k * len(labels) // 10:(k + 1) * len(labels) // 10]) == {"A", "B"}
    runs = 1 + sum(a != b for a, b in zip(labels, labels[1:]))
    expected = 2 * labels.count("A") * labels.count("B") / len(labels)
    assert runs > 0.7 * expected, (runs, expected)

    # Validation: documents of both sources, never in train, never repeated; 10 split by weight: 7 / 3.
    val_labels = [source_of(t, set(small), set(large)) for t in val]
    assert (val_labels.count("A"), val_labels.count("B")) == (7, 3)
    assert not set(val) & set(train) and len(set(val)) == len(val)

    # meta.json and the printed table say the same as the file.
    meta = json.loads((d / "mix" / "meta.json").read_text())
    rows = meta["mixture"]["sources"]
    assert meta["train_tokens"] == total and sum(r["tokens_used"] for r in rows) == total
    assert [round(r["share"], 4) for r in rows] == [round(shares[s], 4) for s in "AB"]
    assert rows[0]["repeat"] > 2 and rows[1]["repeat"] < 0.5 and meta["mixture"]["tokens"] == budget
    assert "small.txt" in stdout and f"{shares['A']:.2%}" in stdout


def test_mixture_without_tokens_repeats_nothing_and_is_seeded(corpus):
    d, small, large, _ = corpus
    common = ["--input", "small.txt", "large.jsonl", "--weights", "7", "3", "--tokenizer", "tok.json",
              "--val_docs", "4"]
    stdout = run_data(d, *common, "--out", "most", "--workers", "1")
    assert "normalized to 0.7 0.3" in stdout
    train, lengths = read_docs(d / "most", "train")
    val, _ = read_docs(d / "most", "val")
    labels = [source_of(t, set(small), set(large)) for t in train]
    assert len(set(train)) == len(train)  # nothing repeated
    assert sorted(t for t, x in zip(train, labels) if x == "A") == sorted(t for t in small if t not in val)  # all of A
    share_a = sum(n for n, x in zip(lengths, labels) if x == "A") / sum(lengths)
    assert abs(share_a - 0.7) < 0.02
    # The seed fixes the order: the same seed (on 2 workers) gives the same bytes, another seed another order.
    run_data(d, *common, "--out", "again", "--workers", "2", "--seed", "0")
    run_data(d, *common, "--out", "other", "--workers", "1", "--seed", "1")
    same = [(d / "most" / f).read_bytes() == (d / "again" / f).read_bytes() for f in ("train.bin", "val.bin")]
    assert same == [True, True]
    assert (d / "most" / "train.bin").read_bytes() != (d / "other" / "train.bin").read_bytes()


def test_plan_mixture_hand_checked():
    lengths = [np.array([10, 10, 10]), np.array([5] * 40)]  # 30 and 200 tokens
    (copies_a, sample_a), (copies_b, sample_b) = plan_mixture(lengths, np.array([0.5, 0.5]), tokens=100)
    assert (copies_a, len(sample_a)) == (1, 2)  # 50 = 30 + two documents of 10
    assert (copies_b, len(sample_b)) == (0, 10)  # 50 = ten documents of 5
    (copies_a, sample_a), (copies_b, sample_b) = plan_mixture(lengths, np.array([0.5, 0.5]))
    assert (copies_a, len(sample_a), copies_b, len(sample_b)) == (1, 0, 0, 6)  # A sets the size: 30 + 30
    assert split_val_docs(10, [0.7, 0.3]) == [7, 3] and split_val_docs(2, [0.99, 0.01]) == [1, 1]
    assert sum(split_val_docs(1000, [0.7, 0.2, 0.04, 0.06])) == 1000
