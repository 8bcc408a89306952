"""data.py: the objectives, the loader, prepare."""

import ast
import json
import lzma
import math
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

from data import Loader, clm_batch, demo_documents, load_meta, mlm_batch, prepare, read_documents
from support.tokenizer import load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    windows = torch.randint(5, 1000, (4, 64))
    a = mlm_batch(windows, 0.3, SPECIAL, 1000, seed=[17, 3, 0, 0])
    b = mlm_batch(windows, 0.3, SPECIAL, 1000, seed=[17, 3, 0, 0])
    c = mlm_batch(windows, 0.3, SPECIAL, 1000, seed=[17, 3, 1, 0])
    assert torch.equal(a.rows, b.rows) and torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.rows, c.rows)
    other = mlm_batch(torch.randint(5, 1000, (4, 64)), 0.3, SPECIAL, 1000, seed=[17, 3, 0, 0])
    assert torch.equal(a.rows, other.rows)  # same seed, different data: same positions


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


def window_ids(batch, seq_len=20):
    """Which windows a batch holds: the shard is 0, 1, 2, ... so a window's first id tells."""
    return [int(row[0]) // seq_len for row in batch]


def test_loader_world_sizes_see_the_same_windows(shards):
    one = Loader(shards, "train", 20, 4, data_seed=42)  # 500 windows; 125 steps of 4
    seen1 = [w for _ in range(125) for w in window_ids(one.next())]
    two = [Loader(shards, "train", 20, 2, data_seed=42, rank=r, world_size=2) for r in range(2)]
    seen2 = [w for _ in range(125) for ld in two for w in window_ids(ld.next())]
    assert sorted(seen1) == sorted(seen2)
    assert len(set(seen1)) == 500  # one epoch visits every window once
    assert not set(window_ids(two[0].next())) & set(window_ids(two[1].next()))  # disjoint ranks


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


def test_data_seed_changes_order_not_set(shards):
    a, b = Loader(shards, "train", 20, 500, data_seed=1), Loader(shards, "train", 20, 500, data_seed=2)
    wa, wb = window_ids(a.next()), window_ids(b.next())
    assert wa != wb and sorted(wa) == sorted(wb)


def test_loader_errors(tmp_path, shards):
    with pytest.raises(SystemExit, match="python data.py --input"):
        Loader(str(tmp_path), "train", 20, 2, data_seed=0)
    with pytest.raises(ValueError, match="fewer than one step"):
        Loader(shards, "val", 512, 4, data_seed=0)


# -----------------------------------------------------------------------------
# 3. prepare


def test_demo_corpus_is_each_docstring_once_in_ast_walk_order():
    """The built-in general corpus against ast.walk over some of the standard library's files (definitions in if
    blocks, in except handlers, nested in classes): each module gives the docstrings of 40 characters or more that
    ast.walk finds, in its order, less those an earlier module gave; no text twice in the corpus."""
    corpus = list(demo_documents("general"))
    texts = [doc for _, doc in corpus]
    assert len(texts) > 1000 and len(set(texts)) == len(texts)
    stdlib = sysconfig.get_paths()["stdlib"]
    for module, path in (("os", "os.py"), ("hashlib", "hashlib.py"), ("queue", "queue.py"), ("argparse", "argparse.py"),
                         ("json", "json/__init__.py"), ("json.decoder", "json/decoder.py")):
        with open(os.path.join(stdlib, path), encoding="utf-8") as f:
            nodes = ast.walk(ast.parse(f.read()))
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(n) for n in nodes if isinstance(n, kinds)]
        first = next(i for i, (m, _) in enumerate(corpus) if m == module)
        earlier = set(texts[:first])
        expected = list(dict.fromkeys(d for d in docs if d and len(d) >= 40 and d not in earlier))
        assert [doc for m, doc in corpus if m == module] == expected, module


def test_prepare_writes_shards_and_meta(tmp_path):
    docs = [f"document number {i} says hello {'world ' * (i % 7)}" for i in range(300)]
    (tmp_path / "a.txt").write_text("\n".join(docs[:200]) + "\n\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs[200:]))
    train_bpe(iter(docs), 400, str(tmp_path / "tok.json"))
    out = tmp_path / "new" / "out"  # its folder is made too
    src = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    meta = prepare(lambda: read_documents(src, text_field="body"), str(tmp_path / "tok.json"), str(out),
                   val_docs=30, workers=1)
    assert sorted(os.listdir(out)) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert meta == load_meta(str(out)) and meta["train_docs"] == 270 and meta["val_docs"] == 30
    tok = load_tokenizer(str(out))
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    assert len(train) == meta["train_tokens"] and (train == tok.eos_id).sum() == 270
    texts = [tok.decode(d) for d in np.split(np.concatenate([train, val]), np.flatnonzero(
        np.concatenate([train, val]) == tok.eos_id) + 1) if len(d)]
    assert sorted(t.removesuffix("[SEP]") for t in texts) == sorted(docs)


def test_prepare_is_deterministic_across_workers(tmp_path):
    docs = [f"line {i} " + "abc " * (i % 13) for i in range(3000)]
    (tmp_path / "in.txt").write_text("\n".join(docs))
    train_bpe(iter(docs), 300, str(tmp_path / "tok.json"))
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(lambda: read_documents([str(tmp_path / "in.txt")]), str(tmp_path / "tok.json"), str(out),
                val_docs=100, workers=workers, chunk_docs=256)
        outs.append((out / "train.bin").read_bytes() + (out / "val.bin").read_bytes())
    assert outs[0] == outs[1]


def test_xz_compressed_inputs_give_the_shards_of_their_text(tmp_path):
    """.txt.xz and .jsonl.xz (Python's lzma, the xz format) are read as the text they hold."""
    docs = [f"text {i} " + "word " * (i % 9) for i in range(120)]
    plain = {"a.txt": "\n".join(docs[:60]) + "\n", "b.jsonl": "\n".join(json.dumps({"text": d}) for d in docs[60:])}
    for name, text in plain.items():
        (tmp_path / name).write_text(text)
        (tmp_path / f"{name}.xz").write_bytes(lzma.compress(text.encode()))
    train_bpe(iter(docs), 300, str(tmp_path / "tok.json"))
    shards = []
    for suffix in ("", ".xz"):
        src = [str(tmp_path / f"{name}{suffix}") for name in plain]
        assert list(read_documents(src)) == docs
        prepare(lambda: read_documents(src), str(tmp_path / "tok.json"), str(tmp_path / f"out{suffix}"), val_docs=10)
        shards.append((tmp_path / f"out{suffix}" / "train.bin").read_bytes())
    assert shards[0] == shards[1]


def run_prepare(*args, cwd):
    return subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), *args], cwd=cwd,
                          capture_output=True, text=True)


def test_prepare_errors(tmp_path):
    train_bpe(iter(["some text here"] * 20), 300, str(tmp_path / "tok.json"))
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "x.csv").write_text("a,b")
    (tmp_path / "bad.jsonl").write_text('{"content": "hi"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "cut.txt.xz").write_bytes(lzma.compress(b"some text\n" * 100)[:40])
    cases = [("missing.txt", "does not exist"), ("empty.txt", "no documents"), ("x.csv", "unknown extension"),
             ("bad.jsonl", "no 'text' field"), ("latin1.txt", "cannot be read as UTF-8"),
             ("cut.txt.xz", "cannot be read as xz-compressed UTF-8 text")]
    for name, message in cases:
        r = run_prepare("--input", name, "--tokenizer", "tok.json", "--out", "o", "--workers", "1", cwd=tmp_path)
        assert r.returncode != 0 and message in r.stderr, (name, r.stderr[-500:])
        assert not os.path.exists(tmp_path / "o" / "train.bin")  # no half files


# -----------------------------------------------------------------------------
# 4. Against an outside expectation: what the stream of windows is, not only that it resumes as itself


def test_two_epochs_are_two_permutations_of_every_window(shards):
    """10,000 tokens make 333 whole windows of 30 (the last 10 tokens are no window). The stream is epoch 0's
    order, then epoch 1's: each a permutation of the 333 windows, the two in different orders, whatever the
    world size, with the epoch boundary inside a step (333 is no multiple of 4 or of 2 x 2)."""
    for world in (1, 2):
        loaders = [Loader(shards, "train", 30, 4 // world, data_seed=42, rank=r, world_size=world)
                   for r in range(world)]
        assert loaders[0].n_windows == 333
        stream = []
        while len(stream) < 2 * 333:
            for ld in loaders:  # a step: the ranks' micro batches, in rank order
                stream += [int(row[0]) // 30 for row in ld.next()]
        first, second = stream[:333], stream[333:666]
        assert sorted(first) == sorted(second) == list(range(333)), "an epoch misses or repeats a window"
        assert first != second, "the second epoch repeats the first one's order"
