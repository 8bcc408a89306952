"""
Token shards, the packed loader and the two objectives' batches for the CLM detour (tokenizers: support/tokenizer.py).

One direction: text files -> `python data.py` -> train.bin / val.bin (token ids, documents separated by the tokenizer's
end-of-document id) + meta.json -> Loader (fixed-length windows in an order fixed by data_seed, sharded by rank,
resumable) -> mlm_batch / clm_batch (the flat unpadded form the model takes). Knows nothing of the model.

    python data.py --input corpus.txt --tokenizer path/to/ModernBERT-base --out data/bio
    python data.py --demo general --tokenizer bpe:4096 --out data/general
    python data.py --input lit.jsonl notes.jsonl --weights 0.8 0.2 --tokens 10B --tokenizer ... --out data/mix
"""

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import json
import lzma
import math
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from support.files import check_out_dir, fresh_dir, json_lines, open_file, remove, sha256, user_error
from support.shards import load_meta, split_tokens
from support.tokenizer import SPECIAL_NAMES, TOKENIZER_FILES, load_tokenizer, tokenizer_file, train_bpe

# -----------------------------------------------------------------------------
# Reading documents: .txt (a document per line or per paragraph), .jsonl, either xz-compressed, .parquet (with
# pyarrow), and the built-in demo corpus.


def check_inputs(paths):
    """Each input file exists and has an extension prepare reads: checked before any work."""
    for path in paths:
        if not os.path.isfile(path):
            raise SystemExit(f"input file {path!r} " + ("is a directory: give its files (e.g. dir/*.jsonl)"
                                                         if os.path.isdir(path) else "does not exist; check the path"))
        if extension(path) not in (".txt", ".jsonl", ".parquet", ".txt.xz", ".jsonl.xz"):
            raise SystemExit(f"{path}: unknown extension {extension(path)!r}; prepare reads .txt, .jsonl, .parquet, "
                             ".txt.xz and .jsonl.xz")


def extension(path):
    """".txt", ".jsonl.xz", ...: the format, and the compression where there is one."""
    stem, ext = os.path.splitext(path.lower())
    return os.path.splitext(stem)[1] + ext if ext == ".xz" else ext


def read_documents(paths, text_field="text", blank_line_docs=False):
    """Yield the documents of the input files, in order: strings, "" for an empty or null text (prepare
    skips and counts those). A text that is not a string is refused with its file and line."""
    check_inputs(paths)
    for path in paths:
        ext = extension(path)
        try:
            if ext == ".parquet":
                yield from _read_parquet(path, text_field)
                continue
            with (lzma.open if ext.endswith(".xz") else open)(path, "rt", encoding="utf-8") as f:
                if ext.startswith(".jsonl"):
                    for n, obj in json_lines(f, path):
                        if not isinstance(obj, dict) or text_field not in obj:
                            raise SystemExit(f"{path}:{n}: no {text_field!r} field; choose the field with --text_field")
                        yield _text(obj[text_field], f"{path}:{n}")
                elif blank_line_docs:  # a document per run of non-blank lines
                    for blank, lines in itertools.groupby(f, key=lambda line: not line.strip()):
                        if not blank:
                            yield "".join(lines).rstrip("\n")
                else:
                    yield from (line.rstrip("\n") for line in f if line.strip())
        except (OSError, EOFError, lzma.LZMAError, UnicodeDecodeError) as e:  # EOFError: an .xz file cut short
            raise SystemExit(f"{path}: cannot be read as {'xz-compressed ' * ext.endswith('.xz')}UTF-8 text "
                             f"({e})") from None


def _read_parquet(path, field):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SystemExit(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.ParquetFile(path)
    if field not in table.schema_arrow.names:
        raise SystemExit(f"{path}: no {field!r} column (columns: {table.schema_arrow.names}); use --text_field")
    texts = (t for batch in table.iter_batches(columns=[field]) for t in batch.column(0).to_pylist())
    for row, t in enumerate(texts, 1):
        yield _text(t, f"{path}: row {row}")


def _text(value, where):
    if value is None or isinstance(value, str):
        return value or ""
    raise SystemExit(f"{where}: the text field holds {type(value).__name__} {str(value)[:40]!r}, not a string; "
                     "fix the line or choose another field with --text_field")


# The nodes that hold statements, where definitions are: none is in an expression, so the walk skips those.
BODIES = (ast.stmt, ast.excepthandler, ast.match_case)


def demo_documents(part):
    """The built-in demo corpus, (module, docstring) pairs read with `ast` from installed code (nothing imported
    or downloaded): "general", the standard library; "domain", PyTorch and NumPy, a domain with its own words."""
    if part == "general":  # module names relative to the stdlib folder: json.decoder
        roots = [(sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["stdlib"])]
    elif part == "domain":  # relative to site-packages: torch.nn.functional
        roots = [(os.path.dirname(m.__file__), os.path.dirname(os.path.dirname(m.__file__))) for m in (torch, np)]
    else:
        raise ValueError(f"unknown demo corpus part {part!r}: 'general' or 'domain'")
    skip = {"test", "tests", "testing", "idlelib", "lib2to3", "site-packages", "dist-packages", "_vendor"}
    seen = set()  # a docstring repeated (a wrapper's, an alias's) is one document, so no task split shares a text
    for root, base in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, base)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                try:
                    with open(path, encoding="utf-8") as f:
                        tree = ast.parse(f.read())
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                nodes = [tree]  # breadth first, as ast.walk, through BODIES only
                for node in nodes:
                    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        doc = ast.get_docstring(node)
                        if doc and len(doc) >= 40 and doc not in seen:
                            seen.add(doc)
                            yield module, doc
                    nodes += [n for n in ast.iter_child_nodes(node) if isinstance(n, BODIES)]


# -----------------------------------------------------------------------------
# prepare: text -> train.bin / val.bin / meta.json

def _tokenized(keyed_docs, tok, chunk_docs, n_docs, desc):
    """(key, ids with an eos after each document, each document's length with its eos) for the non-empty texts of
    keyed_docs ((key, text) pairs), in chunks of up to chunk_docs documents of one key, each encoded on every core."""
    with tqdm(total=n_docs, desc=desc, unit="doc", disable=None) as bar:
        for key, group in itertools.groupby(((k, doc) for k, doc in keyed_docs if doc), key=lambda kd: kd[0]):
            docs = (doc for _, doc in group)
            while chunk := list(itertools.islice(docs, chunk_docs)):
                encoded = [ids + [tok.eos_id] for ids in tok.encode_batch(chunk)]
                yield (key, np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64),
                       np.array([len(ids) for ids in encoded], dtype=np.int64))
                bar.update(len(chunk))


def _count_documents(docs_fn, where):
    """The documents docs_fn() yields, the empty or null texts among them skipped (and counted, in a line)."""
    empty = collections.Counter(not doc for doc in docs_fn())
    if empty[True]:
        print(f"{where}: skipped {empty[True]:,} empty or null texts of {empty.total():,}")
    return empty[False]


@contextlib.contextmanager
def _staged(out, tokenizer):
    """Yields (stage, tok, meta): a staging folder beside out, the tokenizer as copied into it (tokenizer.json and
    its companions), meta.json's tokenizer keys and the shards' dtype for the caller to complete. Then every staged
    file is moved into out: a failed or interrupted run leaves what out held as it was."""
    stage = fresh_dir(os.path.normpath(out) + ".prepare.tmp")  # one that a killed run left is removed
    try:
        load_tokenizer(tokenizer)  # first: a missing or broken tokenizer is said before anything is copied
        path = tokenizer_file(tokenizer)
        for name in TOKENIZER_FILES:
            src = path if name == "tokenizer.json" else os.path.join(os.path.dirname(path), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(stage, name))
        spec = os.path.join(stage, "tokenizer.json")
        tok = load_tokenizer(spec)  # the copy, which the shards are made with and travel beside
        meta = dict(tokenizer="tokenizer.json", tokenizer_sha256=sha256(spec), vocab_size=tok.vocab_size,
                    dtype="uint16" if tok.vocab_size <= 2 ** 16 else "uint32", **tok.special_ids)
        yield stage, tok, meta
        with open_file(os.path.join(stage, "meta.json")) as f:
            json.dump(meta, f, indent=2)
        # meta.json leaves first and comes back last: a kill in between leaves a folder train.py refuses (no
        # meta.json), never old shards beside a new tokenizer; an earlier run's tokenizer file this one lacks goes.
        os.makedirs(out, exist_ok=True)
        for name in ("meta.json", *TOKENIZER_FILES):
            if name == "meta.json" or not os.path.exists(os.path.join(stage, name)):
                remove(os.path.join(out, name))
        for name in sorted(os.listdir(stage), key=lambda n: n == "meta.json"):
            os.replace(os.path.join(stage, name), os.path.join(out, name))
    finally:
        remove(stage)


def prepare(docs_fn, tokenizer, out, val_docs=1000, sources=(), chunk_docs=512):
    """Tokenize the documents docs_fn() yields into out/{train,val}.bin and meta.json, the tokenizer copied beside
    them. docs_fn is called twice (a count, then the pass) so nothing holds the corpus in memory; the val documents
    are drawn at random (seed 0) from the whole input."""
    with _staged(out, tokenizer) as (stage, tok, meta):
        n_docs = _count_documents(docs_fn, "prepare")
        if n_docs == 0:
            raise SystemExit("prepare: the input holds no documents (empty files?)")
        if n_docs <= val_docs:
            raise SystemExit(f"prepare: only {n_docs} documents, not enough for --val_docs {val_docs} plus training")
        val_set = set(np.random.default_rng(0).choice(n_docs, size=val_docs, replace=False).tolist())
        keyed = (("val" if i in val_set else "train", doc) for i, doc in enumerate(d for d in docs_fn() if d))
        meta.update(train_docs=0, train_tokens=0, val_docs=0, val_tokens=0, sources=list(sources))
        with (open_file(os.path.join(stage, "train.bin"), "wb") as train,
              open_file(os.path.join(stage, "val.bin"), "wb") as val,
              contextlib.closing(_tokenized(keyed, tok, chunk_docs, n_docs, "prepare")) as chunks):
            for split, ids, lengths in chunks:
                (val if split == "val" else train).write(ids.astype(meta["dtype"]).tobytes())
                meta[f"{split}_docs"] += len(lengths)
                meta[f"{split}_tokens"] += len(ids)
    return meta


# -----------------------------------------------------------------------------
# Mixtures: `python data.py --input A B C --weights 0.6 0.2 0.2 [--tokens N]`.
#
# The papers' corpora mix sources of very different sizes (French: literature 7B, synthetic QA 2B, clinical
# cases 400M). Each source (input file) is tokenized once into a scratch file; its share of the N training
# tokens is planned in whole documents (a small source repeated, as the paper upsamples; a large one sampled);
# the planned documents are then copied into train.bin, interleaved in an order fixed by the seed. Memory holds
# document offsets, never a source's tokens.


def prepare_mixture(docs_fns, weights, tokenizer, out, tokens=None, val_docs=1000, seed=0, sources=(),
                    chunk_docs=512):
    """prepare for a weighted mixture: docs_fns[i]() yields source i's documents, weights[i] (normalized) of the
    `tokens` training tokens (None: the largest mixture that repeats no document). The val_docs validation
    documents are split over the sources by weight, never repeated, never in train. meta.json adds "mixture"."""
    sources = list(sources) or [f"source {i}" for i in range(len(docs_fns))]
    weights = np.asarray(weights, dtype=np.float64)
    weights = weights / weights.sum()
    with _staged(out, tokenizer) as (stage, tok, meta):
        # count: every source is checked before any tokenizing
        n_docs = [_count_documents(docs_fn, f"prepare: {name}") for name, docs_fn in zip(sources, docs_fns)]
        n_val = split_val_docs(val_docs, weights)
        for name, n, v in zip(sources, n_docs, n_val):
            if n <= v:
                raise SystemExit(f"prepare: {name} has {n} document(s), too few to give one to training beside its "
                                 f"{v} validation document(s) (--val_docs {val_docs}, split by weight)")
        scratch = os.path.join(stage, "sources.tmp")
        keyed = ((i, doc) for i, docs_fn in enumerate(docs_fns) for doc in docs_fn())
        doc_tokens = []  # each document's tokens (eos included), in the scratch file's order
        with (open_file(scratch, "wb") as f,
              contextlib.closing(_tokenized(keyed, tok, chunk_docs, sum(n_docs), "tokenize")) as chunks):
            for _, ids, lengths in chunks:
                f.write(ids.astype(meta["dtype"]).tobytes())
                doc_tokens.append(lengths)
        doc_tokens = np.concatenate(doc_tokens)
        offsets = np.concatenate([[0], np.cumsum(doc_tokens)])  # document d: tokens offsets[d]:offsets[d+1]
        first = np.cumsum([0, *n_docs])  # each source's first document
        val, train = [], []  # each source's documents of each split (ids into offsets, in file order)
        for i, (n, v) in enumerate(zip(n_docs, n_val)):
            is_val = np.isin(np.arange(n), np.random.default_rng([seed, 0, i]).choice(n, size=v, replace=False))
            val.append(first[i] + np.flatnonzero(is_val))
            train.append(first[i] + np.flatnonzero(~is_val))
        plan = plan_mixture([doc_tokens[d] for d in train], weights, tokens, seed, sources)
        used = [np.concatenate([np.tile(d, copies), d[sample]]) for d, (copies, sample) in zip(train, plan)]
        token_file = np.memmap(scratch, dtype=meta["dtype"], mode="r")
        meta["train_docs"], meta["train_tokens"] = _write_interleaved(
            os.path.join(stage, "train.bin"), token_file, offsets, used, np.random.default_rng([seed, 2, 0]), "train")
        meta["val_docs"], meta["val_tokens"] = _write_interleaved(
            os.path.join(stage, "val.bin"), token_file, offsets, val, np.random.default_rng([seed, 2, 1]), "val")
        del token_file
        os.remove(scratch)
        rows = []
        for name, w, d, u, v in zip(sources, weights, train, used, val):
            available, taken = int(doc_tokens[d].sum()), int(doc_tokens[u].sum())
            rows.append(dict(path=name, weight=round(float(w), 6), documents=len(d), tokens=available,
                             documents_used=len(u), tokens_used=taken, share=round(taken / meta["train_tokens"], 6),
                             repeat=round(taken / available, 6), val_docs=len(v), val_tokens=int(doc_tokens[v].sum())))
        meta.update(sources=list(sources), mixture=dict(seed=seed, tokens=tokens, sources=rows))
    return meta


def split_val_docs(val_docs, weights):
    """val_docs split over the sources by weight, at least one each (largest remainders; check_args: enough)."""
    quota = np.asarray(weights) * (val_docs - len(weights))
    n = 1 + np.floor(quota).astype(np.int64)
    n[np.argsort(np.floor(quota) - quota, kind="stable")[:val_docs - int(n.sum())]] += 1
    return n.tolist()


def plan_mixture(lengths, weights, tokens=None, seed=0, names=None):
    """Each source's share of the training tokens, in whole documents. lengths[i]: the lengths of source i's
    training documents (eos included); weights: shares that sum to 1; tokens: the mixture's size (None: the
    largest mixture in which no source repeats a document). -> per source (copies, sample): all of its
    documents `copies` times, then the documents `sample` (indices into lengths[i], ascending), a random set
    (fixed by seed) whose tokens come closest to the rest of the share: off by at most half a document."""
    available = np.array([int(x.sum()) for x in lengths], dtype=np.int64)
    size = np.min(available / weights) if tokens is None else tokens  # None: the source that runs out first sets it
    targets = np.rint(np.asarray(weights) * size).astype(np.int64)
    if tokens is None:
        targets = np.minimum(targets, available)  # rounding never makes a source repeat
    plan = []
    for i, (x, target) in enumerate(zip(lengths, targets)):
        copies, rest = divmod(int(target), int(available[i]))
        order = np.random.default_rng([seed, 1, i]).permutation(len(x))
        reached = np.cumsum(x[order])  # reached[k]: the tokens of order's first k + 1 documents
        k = int(np.searchsorted(reached, rest))  # k documents fall short of rest, k + 1 reach it
        if k < len(x) and reached[k] - rest < rest - (reached[k - 1] if k else 0):
            k += 1
        if copies == 0 and k == 0:
            name = names[i] if names else f"source {i}"
            raise SystemExit(f"prepare: {name}: its share ({target:,} tokens) is too small for one of its "
                             "documents; raise --tokens or its weight")
        plan.append((copies, np.sort(order[:k])))
    return plan


def _write_interleaved(path, token_file, offsets, streams, rng, desc):
    """Copy the streams' documents (arrays of ids into offsets) from token_file into path, interleaved by a shuffle
    (rng) of their labels: every source is spread over the whole file, in its own order. -> (documents, tokens)."""
    labels = rng.permutation(np.repeat(np.arange(len(streams), dtype=np.uint16), [len(docs) for docs in streams]))
    order = np.empty(len(labels), dtype=np.int64)  # the file's documents, as ids into offsets
    for i, docs in enumerate(streams):
        order[labels == i] = docs
    with open_file(path, "wb") as f, tqdm(total=len(order), desc=desc, unit="doc", disable=None) as bar:
        for b in range(0, len(order), 1 << 16):
            ids = order[b:b + (1 << 16)]
            for start, end in zip(offsets[ids].tolist(), offsets[ids + 1].tolist()):
                f.write(token_file[start:end])
            bar.update(len(ids))
    return len(order), int((offsets[order + 1] - offsets[order]).sum())


def mixture_table(meta):
    """The mixture of a meta.json as a small table: what data.py prints."""
    lines = [f"{'source':<32} {'weight':>7} {'documents':>11} {'tokens':>15} {'tokens used':>15} {'share':>7} "
             f"{'repeat':>7} {'val docs':>8}"]
    for s in meta["mixture"]["sources"]:
        name = os.path.basename(s["path"])
        lines.append(f"{name[-32:]:<32} {s['weight']:>7.4f} {s['documents']:>11,} {s['tokens']:>15,} "
                     f"{s['tokens_used']:>15,} {s['share']:>7.2%} {s['repeat']:>6.2f}x {s['val_docs']:>8,}")
    return "\n".join(lines)


# -----------------------------------------------------------------------------
# The loader: fixed windows of a memmapped .bin. The stream of windows is epoch 0's permutation (by data_seed),
# then epoch 1's, ... A step takes the next world * micro_batch windows; rank r takes its own contiguous slice.
# The whole state is the count of windows consumed: a run resumes exactly, even at another world size.


class Loader:
    def __init__(self, data_dir, split, seq_len, micro_batch_size, data_seed, rank=0, world_size=1):
        self.meta = load_meta(data_dir)
        self.tokens, self.n_windows = split_tokens(data_dir, split, self.meta, seq_len, micro_batch_size, world_size)
        self.seq_len, self.micro_batch_size, self.data_seed = seq_len, micro_batch_size, data_seed
        self.rank, self.world_size = rank, world_size
        self.consumed = 0  # windows of the stream consumed by all ranks together
        self._perm_epoch, self._perm = None, None

    def _window_index(self, g):
        epoch, pos = divmod(g, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.data_seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm[pos]

    def next(self):
        """This rank's next micro batch: (micro_batch_size, seq_len) int64 tokens."""
        start = self.consumed + self.rank * self.micro_batch_size
        idx = [self._window_index(g) for g in range(start, start + self.micro_batch_size)]
        self.consumed += self.world_size * self.micro_batch_size
        windows = np.stack([self.tokens[i * self.seq_len:(i + 1) * self.seq_len] for i in idx])
        # An id past the vocabulary (a file changed since data.py wrote it) would index past the embedding: a max
        # per window costs nothing next to a step. prefetch raises it at its step: the run stops there, in one line.
        if windows.max() >= self.meta["vocab_size"]:
            at = idx[int(np.argmax(windows.max(1) >= self.meta["vocab_size"]))] * self.seq_len
            raise SystemExit(f"{self.tokens.filename}: holds token id {windows.max()} (near token {at:,}), past the "
                             f"vocabulary of its meta.json (vocab_size={self.meta['vocab_size']}): the file is not "
                             "what data.py wrote; prepare the data again (the checkpoints written so far are intact)")
        return torch.from_numpy(windows.astype(np.int64))

    def skip(self, tokens):
        """Move past the first `tokens` tokens of the stream, in whole windows: where an uninterrupted run that had
        trained on them stands. -> the tokens skipped."""
        windows = tokens // self.seq_len
        self.consumed += windows
        return windows * self.seq_len

    def state_dict(self):
        return {"consumed": self.consumed, "data_seed": self.data_seed, "seq_len": self.seq_len}

    def load_state_dict(self, state):
        if state["data_seed"] != self.data_seed or state["seq_len"] != self.seq_len:
            raise ValueError(f"loader state is for data_seed={state['data_seed']} seq_len={state['seq_len']}, "
                             f"not {self.data_seed} / {self.seq_len}")
        self.consumed = state["consumed"]


# -----------------------------------------------------------------------------
# The two objectives: (B, S) windows -> the flat unpadded batch the model takes; only the targets differ.


@dataclass
class Batch:
    tokens: torch.Tensor  # (T,) model input (masked for MLM)
    cu_seqlens: torch.Tensor  # (B+1,) int32
    max_seqlen: int
    rows: torch.Tensor  # (N,) positions in tokens that have a target
    targets: torch.Tensor  # (N,) the target ids

    def map(self, fn):
        return Batch(fn(self.tokens), fn(self.cu_seqlens), self.max_seqlen, fn(self.rows), fn(self.targets))

    def to(self, device, non_blocking=False):
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pinned(self, device):
        """In pinned memory if bound for a GPU: the copy there is then asynchronous."""
        return self.map(torch.Tensor.pin_memory) if device.type == "cuda" else self


def _layout(windows, eos_id, split_docs):
    """cu_seqlens for (B, S) windows: one sequence per window, or per document (ending after its eos) when
    split_docs, so attention and positions restart at each document."""
    B, S = windows.shape
    if not split_docs:
        return torch.arange(0, (B + 1) * S, S, dtype=torch.int32), S
    ends = (windows == eos_id)
    ends[:, -1] = True  # every window ends a sequence
    cut = ends.flatten().nonzero().squeeze(1) + 1  # exclusive end of each sequence
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), cut]).to(torch.int32)
    return cu, int(cu.diff().max())


def clm_batch(windows, eos_id, split_docs=False):
    """Next-token targets for every position whose next token is in the same sequence."""
    cu, max_seqlen = _layout(windows, eos_id, split_docs)
    tokens = windows.flatten()
    last = torch.zeros(tokens.numel(), dtype=torch.bool)
    last[cu[1:].long() - 1] = True  # the last token of a sequence has no next token
    rows = (~last).nonzero().squeeze(1)
    return Batch(tokens, cu, max_seqlen, rows, tokens[rows + 1])


def mlm_batch(windows, mask_prob, special, vocab_size, seed, split_docs=False):
    """BERT masking of `mask_prob` of the non-special tokens: 80% [MASK], 10% a random token, 10% unchanged.
    `seed` (e.g. [training seed, step, rank, micro step]) drives its own generator: masking never depends on data."""
    cu, max_seqlen = _layout(windows, special["eos_id"], split_docs)
    tokens = windows.flatten()
    g = torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)[0] >> 1))
    maskable = ~torch.isin(tokens, torch.tensor(sorted({special[k] for k in SPECIAL_NAMES})))
    chosen = (torch.rand(tokens.shape, generator=g) < mask_prob) & maskable
    rows = chosen.nonzero().squeeze(1)
    targets = tokens[rows]
    action = torch.rand(rows.shape, generator=g)
    random_ids = torch.randint(0, vocab_size, rows.shape, generator=g)
    inputs = tokens.clone()
    inputs[rows] = torch.where(action < 0.8, special["mask_id"], torch.where(action < 0.9, random_ids, targets))
    return Batch(inputs, cu, max_seqlen, rows, targets)


def prefetch(produce, steps):
    """Yield produce(step) for each of `steps`, built up to two steps ahead by one background thread so that a step's
    CPU work (reading, masking, pinning) overlaps the GPU work of the steps before. produce() runs in step order: the
    stream is the same as without it, and its exception is raised here, at its step."""
    steps = iter(steps)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
    ahead = collections.deque(pool.submit(produce, step) for step in itertools.islice(steps, 2))
    try:
        while ahead:
            item = ahead.popleft().result()
            ahead.extend(pool.submit(produce, step) for step in itertools.islice(steps, 1))
            yield item
    finally:  # on close(): the thread ends here (within a step's batches), not at the interpreter's exit
        pool.shutdown(cancel_futures=True)


# -----------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", help=".txt / .jsonl (either may be .xz-compressed) / .parquet files")
    src.add_argument("--demo", choices=["general", "domain"], help="the built-in docstring corpus")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, a folder holding one, or bpe:N to train one")
    p.add_argument("--out", required=True)
    p.add_argument("--val_docs", type=int, default=1000)
    p.add_argument("--text_field", default="text", help="the text field of .jsonl / .parquet")
    p.add_argument("--blank_line_docs", action="store_true",
                    help=".txt: documents are separated by blank lines (default: one per line)")
    p.add_argument("--weights", nargs="+", type=float,
                    help="a mixture: each --input file's share of the training tokens (normalized to sum to 1); "
                         "its documents are interleaved with the other files'")
    p.add_argument("--tokens", type=token_count,
                    help="the mixture's training tokens (10B, 400M, 2500000): a source is repeated (whole "
                         "documents) or sampled to its share; default: the largest mixture that repeats nothing")
    p.add_argument("--seed", type=int, help="the mixture's seed (default 0): its validation docs, samples, order")
    return p.parse_args(argv)


def token_count(text):
    """--tokens: '10B', '400M', '2.5e9' or '2500000' -> an int."""
    scale = {"k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "t": 10 ** 12}.get(text[-1:].lower(), 1)
    try:
        n = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        n = float("nan")
    if not (math.isfinite(n) and n >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive token count (10B, 400M, 2500000)")
    return int(n)


def main(argv=None):
    args = parse_args(argv)
    check_args(args)

    if args.demo:
        docs = [doc for _, doc in demo_documents(args.demo)]  # a few MB: parse the sources once
        docs_fn = functools.partial(iter, docs)
        sources = [f"demo:{args.demo}"]
    else:
        docs_fn = functools.partial(read_documents, args.input, args.text_field, args.blank_line_docs)
        sources = [os.path.abspath(x) for x in args.input]
    if args.weights and abs(sum(args.weights) - 1) > 1e-6:
        print(f"--weights sum to {sum(args.weights):g}: normalized to "
              f"{' '.join(f'{w / sum(args.weights):.4g}' for w in args.weights)}")
    with tempfile.TemporaryDirectory() as scratch:  # a tokenizer trained here is copied in with the shards
        tokenizer = args.tokenizer
        if tokenizer.startswith("bpe:"):
            tokenizer = os.path.join(scratch, "tokenizer.json")
            train_bpe(docs_fn(), int(args.tokenizer[4:]), tokenizer)
        if args.weights:  # one source per input file
            docs_fns = [functools.partial(read_documents, [path], args.text_field, args.blank_line_docs)
                        for path in args.input]
            meta = prepare_mixture(docs_fns, args.weights, tokenizer, args.out, args.tokens, args.val_docs,
                                   args.seed or 0, sources)
        else:
            meta = prepare(docs_fn, tokenizer, args.out, args.val_docs, sources)
    print(f"wrote {args.out}: {meta['train_tokens']:,} train tokens in {meta['train_docs']:,} documents, "
          f"{meta['val_tokens']:,} val tokens in {meta['val_docs']:,} documents ({meta['dtype']})")
    if "mixture" in meta:
        print(mixture_table(meta))


def check_args(args):
    """Everything the command line says, checked before any file is read or written."""
    if args.val_docs < 1:
        raise SystemExit(f"--val_docs {args.val_docs}: must be at least 1")
    if args.input:
        check_inputs(args.input)
    if args.weights is None and (args.tokens is not None or args.seed is not None):
        raise SystemExit("--tokens and --seed size and order a mixture: give --weights too, one per --input file")
    if args.weights is not None:  # a mixture: checked before a tokenizer is trained
        if not args.input:
            raise SystemExit("--weights mixes --input files; --demo is one corpus")
        weights, n = args.weights, len(args.input)
        if len(weights) != n:
            raise SystemExit(f"--weights has {len(weights)} value(s) for {n} --input file(s): give one weight per file")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise SystemExit(f"--weights {' '.join(f'{w:g}' for w in weights)}: every weight must be a positive number")
        if args.val_docs < n:
            raise SystemExit(f"--val_docs {args.val_docs}: a mixture of {n} sources needs a validation doc from each")
    check_out_dir(args.out)
    spec = args.tokenizer
    if spec.startswith("bpe:"):
        if not spec[4:].isdigit() or int(spec[4:]) < 262:
            raise SystemExit(f"--tokenizer {spec}: write bpe:N, N > 261 (256 bytes and 5 special tokens): bpe:4096")
        return
    with user_error(f"--tokenizer {spec}: cannot load it"):
        load_tokenizer(spec)


if __name__ == "__main__":
    main()
