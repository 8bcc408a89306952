"""data.py: the objectives, the loader, prepare."""

import ast
import contextlib
import io
import json
import lzma
import math
import os
import random
import sysconfig

import numpy as np
import pytest
import torch

import data
from data import (Loader, clm_batch, demo_documents, load_meta, mlm_batch, plan_mixture, prepare, read_documents,
                  split_val_docs)
from support.tokenizer import load_tokenizer, train_bpe

# -----------------------------------------------------------------------------
# 1. MLM masking statistics; CLM targets


SPECIAL = dict(cls_id=1, sep_id=2, pad_id=0, mask_id=4, eos_id=2)


def test_mlm_masking_statistics():
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(5, 1000, (1000, 1000), generator=g)  # 1e6 tokens
    windows[:, ::50] = SPECIAL["sep_id"]
    windows[:, 0] = SPECIAL["cls_id"]
    windows[::7, -3:] = SPECIAL["pad_id"]
    p = 0.3
    batch = mlm_batch(windows, p, SPECIAL, 1000, seed=[17, 5, 0, 0])
    flat = windows.flatten()
    maskable = ~torch.isin(flat, torch.tensor([0, 1, 2, 4]))
    n = int(maskable.sum())
    k = batch.rows.numel()
    assert abs(k - n * p) < 4 * math.sqrt(n * p * (1 - p))
    assert maskable[batch.rows].all(), "a special token was chosen for masking"
    assert torch.equal(batch.targets, flat[batch.rows])
    changed_to_mask = (batch.tokens[batch.rows] == SPECIAL["mask_id"]).sum().item()
    kept = (batch.tokens[batch.rows] == flat[batch.rows]).sum().item()
    # kept also catches random draws that hit the original token (1/1000 of the 10%)
    for observed, share in [(changed_to_mask, 0.8), (kept, 0.1 + 0.1 / 1000)]:
        assert abs(observed - k * share) < 4 * math.sqrt(k * share * (1 - share))
    unchosen = torch.ones_like(flat, dtype=torch.bool)
    unchosen[batch.rows] = False
    assert torch.equal(batch.tokens[unchosen], flat[unchosen])


def test_mlm_masking_depends_on_seed_not_data():
    windows, other = torch.randint(5, 1000, (2, 4, 64))
    a, b, c = (mlm_batch(w, 0.3, SPECIAL, 1000, seed=[17, 3, 0, 0]) for w in (windows, windows, other))
    assert torch.equal(a.rows, b.rows) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.rows, c.rows)  # same seed, different data: same positions
    assert not torch.equal(a.rows, mlm_batch(windows, 0.3, SPECIAL, 1000, seed=[17, 3, 1, 0]).rows)


def test_clm_targets_hand_checked():
    windows = torch.tensor([[10, 11, 2, 12, 13], [14, 2, 15, 16, 17]])
    b = clm_batch(windows, eos_id=2)
    assert b.cu_seqlens.tolist() == [0, 5, 10] and b.max_seqlen == 5
    assert b.rows.tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert b.targets.tolist() == [11, 2, 12, 13, 2, 15, 16, 17]
    split = clm_batch(windows, eos_id=2, split_docs=True)  # attention restarts after each eos
    assert split.cu_seqlens.tolist() == [0, 3, 5, 7, 10] and split.max_seqlen == 3
    assert split.targets.tolist() == [11, 2, 13, 2, 16, 17]


# -----------------------------------------------------------------------------
# 2. The loader


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    ids = np.arange(10_000, dtype=np.uint16)
    ids.tofile(out / "train.bin")
    ids[:1000].tofile(out / "val.bin")
    json.dump(dict(dtype="uint16", vocab_size=10_000, **SPECIAL), open(out / "meta.json", "w"))
    return str(out)


def test_loader_resumes_exactly_and_reshards(shards):
    a = Loader(shards, "train", 20, 3, data_seed=7)
    for _ in range(170):  # past the end of the first epoch (166 steps of 3)
        a.next()
    state = a.state_dict()
    expected = [a.next() for _ in range(5)]
    b = Loader(shards, "train", 20, 3, data_seed=7)
    b.load_state_dict(state)
    assert all(torch.equal(x, b.next()) for x in expected)
    # Resume the same stream on two ranks: together they see what one rank would have seen.
    one = Loader(shards, "train", 20, 4, data_seed=7)
    one.load_state_dict(state)
    halves = [Loader(shards, "train", 20, 2, data_seed=7, rank=r, world_size=2) for r in range(2)]
    for ld in halves:
        ld.load_state_dict(state)
    assert torch.equal(one.next(), torch.cat([ld.next() for ld in halves]))


def test_two_epochs_are_two_permutations_of_every_window(shards):
    """10,000 tokens make 333 whole windows of 30 (the last 10 tokens are no window). The stream is epoch 0's
    order, then epoch 1's: each a permutation of the 333 windows, the two in different orders, whatever the
    world size (the ranks' windows disjoint), with the epoch boundary inside a step (333 is no multiple of 4 or of
    2 x 2). Another data_seed gives another order of the same windows."""
    orders = []
    for world, seed in ((1, 42), (2, 42), (1, 43)):
        loaders = [Loader(shards, "train", 30, 4 // world, data_seed=seed, rank=r, world_size=world)
                   for r in range(world)]
        assert loaders[0].n_windows == 333
        stream = []
        while len(stream) < 2 * 333:
            for ld in loaders:  # a step: the ranks' micro batches, in rank order; the shard is 0, 1, 2, ...
                stream += [int(row[0]) // 30 for row in ld.next()]  # so a window's first id says which it is
        first, second = stream[:333], stream[333:666]
        assert sorted(first) == sorted(second) == list(range(333)), "an epoch misses or repeats a window"
        assert first != second, "the second epoch repeats the first one's order"
        orders.append(stream[:666])
    assert orders[0] == orders[1] != orders[2]


# -----------------------------------------------------------------------------
# 3. prepare


def test_demo_corpus_is_each_docstring_once_in_ast_walk_order():
    """The built-in general corpus against ast.walk over some of the standard library's files (definitions in if
    blocks, in except handlers, nested in classes; a package's __init__, a module in a package): each module gives
    the docstrings of 40 characters or more that ast.walk finds, in its order, less those an earlier module gave;
    no text twice in the corpus (read up to the last of these modules: the whole of it takes seconds more)."""
    wanted = {"os": "os.py", "hashlib": "hashlib.py", "queue": "queue.py", "argparse": "argparse.py",
              "asyncio.events": "asyncio/events.py", "collections": "collections/__init__.py"}
    corpus, modules = [], set()
    for module, doc in demo_documents("general"):
        if module not in modules and wanted.keys() <= modules:  # past the last of them, read whole
            break
        corpus.append((module, doc))
        modules.add(module)
    texts = [doc for _, doc in corpus]
    assert len(texts) > 1000 and len(set(texts)) == len(texts)
    stdlib = sysconfig.get_paths()["stdlib"]
    for module, path in wanted.items():
        with open(os.path.join(stdlib, path), encoding="utf-8") as f:
            nodes = ast.walk(ast.parse(f.read()))
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(n) for n in nodes if isinstance(n, kinds)]
        first = next(i for i, (m, _) in enumerate(corpus) if m == module)
        earlier = set(texts[:first])
        expected = list(dict.fromkeys(d for d in docs if d and len(d) >= 40 and d not in earlier))
        assert expected and [doc for m, doc in corpus if m == module] == expected, module


def test_prepare_writes_shards_and_meta(tmp_path):
    """.txt and .jsonl, plain or xz-compressed (Python's lzma, the xz format), are read as the documents they hold;
    the shards hold each document once, with its eos."""
    docs = [f"document number {i} says hello {'world ' * (i % 7)}" for i in range(300)]
    plain = {"a.txt": "\n".join(docs[:200]) + "\n\n", "b.jsonl": "\n".join(json.dumps({"body": d}) for d in docs[200:])}
    for name, text in plain.items():
        (tmp_path / name).write_text(text)
        (tmp_path / f"{name}.xz").write_bytes(lzma.compress(text.encode()))
    for suffix in ("", ".xz"):
        assert list(read_documents([str(tmp_path / f"{name}{suffix}") for name in plain], text_field="body")) == docs
    train_bpe(iter(docs), 400, str(tmp_path / "tok.json"))
    src = [str(tmp_path / "a.txt.xz"), str(tmp_path / "b.jsonl.xz")]
    out = tmp_path / "w" / "out"  # its folder is made too
    meta = prepare(lambda: read_documents(src, text_field="body"), str(tmp_path / "tok.json"), str(out), val_docs=30,
                   chunk_docs=64)
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert meta == load_meta(str(out)) and meta["train_docs"] == 270 and meta["val_docs"] == 30
    (train, lengths), (val, _) = read_docs(out, "train"), read_docs(out, "val")
    assert sum(lengths) == meta["train_tokens"] and len(train) == 270
    assert sorted(train + val) == sorted(docs)


# ---------------------------------------------------------------------------------------------------------------------
# data.py's weighted mixtures (`--input A B --weights 0.7 0.3 --tokens N`), checked on what train.bin and
# val.bin hold, not on data.py's own bookkeeping: the two sources are written in disjoint alphabets, so every
# document read back from the shards says which source it came from and which of its documents it is.


def texts(letters, n, seed):
    """n distinct documents of 4-40 words over the given letters."""
    rng, out = random.Random(seed), set()
    while len(out) < n:
        out.add(" ".join("".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(rng.randint(4, 40))))
    return sorted(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Source A, 'small': 60 documents over a-h; source B, 'large': 600 over s-z; a BPE trained on both; each
    document's source ('A' or 'B': a text that is not one whole document of either is a KeyError)."""
    d = tmp_path_factory.mktemp("mixture")
    small, large = texts("abcdefgh", 60, 0), texts("stuvwxyz", 600, 1)
    (d / "small.txt").write_text("\n".join(small) + "\n")
    (d / "large.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in large))
    train_bpe(iter(small + large), 400, str(d / "tok.json"))
    tok = load_tokenizer(str(d / "tok.json"))
    small_tokens = sum(len(ids) + 1 for ids in tok.encode_batch(small))  # with eos, as in the shards
    return d, small, large, {**dict.fromkeys(small, "A"), **dict.fromkeys(large, "B")}, small_tokens


def read_docs(out, split):
    """The documents of out/split.bin as texts, in file order, and their lengths in tokens (eos included)."""
    meta = json.loads((out / "meta.json").read_text())
    tok = load_tokenizer(str(out))
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
    assert ids[-1] == tok.eos_id
    docs = np.split(ids, np.flatnonzero(ids == tok.eos_id)[:-1] + 1)
    return [tok.tok.decode(d[:-1].tolist(), skip_special_tokens=False) for d in docs], [len(d) for d in docs]


def run_data(cwd, *args):
    """data.py's main in this process, run in cwd: what it prints."""
    printed = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(printed):
        data.main([str(a) for a in args])
    return printed.getvalue()


def test_mixture_shares_counted_in_train_bin(corpus):
    d, small, large, source, small_tokens = corpus
    budget = 3 * small_tokens  # A's 70% is 2.1x all of A (more after its validation documents): A must repeat
    stdout = run_data(d, "--input", "small.txt", "large.jsonl", "--weights", "0.7", "0.3", "--tokens", str(budget),
                      "--tokenizer", "tok.json", "--out", "mix", "--val_docs", "10")
    train, lengths = read_docs(d / "mix", "train")
    labels = [source[t] for t in train]
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
    val_labels = [source[t] for t in val]
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
    d, small, _, source, _ = corpus
    common = ["--input", "small.txt", "large.jsonl", "--weights", "7", "3", "--tokenizer", "tok.json",
              "--val_docs", "4"]
    stdout = run_data(d, *common, "--out", "most")
    assert "normalized to 0.7 0.3" in stdout
    train, lengths = read_docs(d / "most", "train")
    val, _ = read_docs(d / "most", "val")
    labels = [source[t] for t in train]
    assert len(set(train)) == len(train)  # nothing repeated
    assert sorted(t for t, x in zip(train, labels) if x == "A") == sorted(t for t in small if t not in val)  # all of A
    share_a = sum(n for n, x in zip(lengths, labels) if x == "A") / sum(lengths)
    assert abs(share_a - 0.7) < 0.02
    # The seed fixes the order: the same seed gives the same bytes, another seed another order.
    run_data(d, *common, "--out", "again", "--seed", "0")
    run_data(d, *common, "--out", "other", "--seed", "1")
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
