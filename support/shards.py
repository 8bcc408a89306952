"""
The token shards `python data.py` writes and the loader reads, with their format's checks.

train.bin and val.bin (uint16 or uint32 ids, documents separated by the end-of-document id), meta.json (the
tokenizer's sha256, vocab size, dtype, special ids, counts) and the tokenizer files, read here for train.py, the loader,
the checkpoints and the model card. The ids themselves are checked by the loader window by window: a scan of a large
train.bin would cost minutes.
"""

import hashlib
import os
import re
import sys

import numpy as np

from support.files import MAX_JSON, read_bytes, read_json, refuse, user_error, whole
from support.tokenizer import MAX_VOCAB, SPECIAL_NAMES, TOKENIZER_FILES, check_companions

DTYPES = {"uint16": 1 << 16, "uint32": 1 << 32}  # the shard formats, and the ids each can hold
COUNTS = ("train_docs", "train_tokens", "val_docs", "val_tokens")


def load_meta(data_dir):
    """meta.json of a data directory, once it and its tokenizer files are well formed (the hash: tokenizer_files)."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.lexists(path):
        raise SystemExit(f"{data_dir}: no meta.json; make the shards first with "
                         f"`python data.py --input FILES --tokenizer SPEC --out {data_dir}`")
    try:
        meta = read_json(path)
        if problem := meta_problem(meta):
            raise ValueError(f"{path}: {problem}")
        check_companions(data_dir)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: prepare the data again with `python data.py` into a fresh --out") from None
    return meta


def tokenizer_files(data_dir):
    """{name: bytes} of the data's tokenizer files, which every checkpoint copies: tokenizer.json once its sha256 is
    meta.json's (wherever a link there leads), another once it is no link (one would copy a file from elsewhere)."""
    files = {}
    try:
        sha = read_json(os.path.join(data_dir, "meta.json")).get("tokenizer_sha256")
        for name in TOKENIZER_FILES:
            src = os.path.join(data_dir, name)
            known = sha if name == "tokenizer.json" else None
            if os.path.islink(src) and not known:
                refuse(src, f"a symbolic link to {os.readlink(src)}, which would copy that file into every checkpoint")
            if os.path.lexists(src) or known:
                files[name] = read_bytes(src, MAX_JSON)
                if known and hashlib.sha256(files[name]).hexdigest() != known:
                    raise SystemExit(f"{src} is not the tokenizer the shards of {data_dir} were made with (meta.json "
                                     "records another sha256): put that one back, or re-run data.py into a fresh --out")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: the checkpoints copy the tokenizer from the data directory") from None
    return files


def meta_problem(meta):
    """What is wrong with the fields of a meta.json (a dict), or None."""
    if missing := [k for k in ("vocab_size", "dtype", *SPECIAL_NAMES) if k not in meta]:
        return f"lacks {', '.join(missing)}"
    dtype, vocab = meta["dtype"], meta["vocab_size"]
    if dtype not in list(DTYPES):  # a list: a hostile value may be unhashable
        return f"dtype={dtype!r} is not a shard format (uint16 or uint32)"
    if not whole(vocab, 1, min(DTYPES[dtype], MAX_VOCAB)):
        return f"vocab_size={vocab!r} must be a whole number from 1 to {min(DTYPES[dtype], MAX_VOCAB):,} ({dtype} ids)"
    bad = ([f"{k}={meta[k]!r} must be a token id below vocab_size={vocab}" for k in SPECIAL_NAMES
            if not whole(meta[k], 0, vocab - 1)]
           + [f"{k}={meta[k]!r} must be a whole number" for k in COUNTS if k in meta and not whole(meta[k])])
    if not isinstance(meta.get("tokenizer", ""), str) or not isinstance(meta.get("sources", []), list):
        bad.append(f"tokenizer={meta.get('tokenizer')!r} must be a name, sources={meta.get('sources')!r} a list")
    sha = meta.get("tokenizer_sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        bad.append(f"tokenizer_sha256={str(sha)[:70]!r} must be a sha256 in hex, or null")
    return "; ".join(bad) or None


def split_tokens(data_dir, split, meta, seq_len, micro_batch_size, world):
    """The split's tokens (memmapped) and its number of windows of seq_len tokens, once the file makes a micro batch
    on every rank and is as long as meta.json counts; else a ValueError that names the fix."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing or is not a file: prepare the data again with `python data.py`")
    size, itemsize, counted = os.path.getsize(path), np.dtype(meta["dtype"]).itemsize, meta.get(f"{split}_tokens")
    n, need = size // itemsize // seq_len, micro_batch_size * world
    if n < need:
        fix = "prepare the data with a larger --val_docs" if split == "val" else "use more data"
        raise ValueError(f"{path} makes {n} windows of seq_len={seq_len}, fewer than one step needs on every rank "
                         f"(micro_batch_size={micro_batch_size} x world size {world} = {need}); {fix}, or lower "
                         "micro_batch_size or seq_len")
    if counted is not None and size != counted * itemsize:
        raise ValueError(f"{path} has {size:,} bytes, but meta.json's {split}_tokens={counted:,} ids of "
                         f"{meta['dtype']} make {counted * itemsize:,}: it is not the file data.py wrote beside this "
                         "meta.json (cut short, or from another run); prepare the data again with `python data.py`")
    return np.memmap(path, dtype=meta["dtype"], mode="r"), n


def check_data(data_dir, seq_len, micro_batch_size, world, windows):
    """-> meta.json of a run's data_dir, once its tokenizer files are those each checkpoint will copy and both splits
    make a micro batch on every rank of `world`; a note where the run's `windows` outnumber train.bin's (it repeats)."""
    if not data_dir:
        raise SystemExit("data_dir is not set: point it at a directory made by `python data.py`")
    meta = load_meta(data_dir)
    tokenizer_files(data_dir)
    with user_error():
        _, n = split_tokens(data_dir, "train", meta, seq_len, micro_batch_size, world)
        split_tokens(data_dir, "val", meta, seq_len, micro_batch_size, world)
    if windows > n and int(os.environ.get("RANK", 0)) == 0:
        print(f"note: the schedule reads {windows:,} windows of {seq_len} tokens and train.bin holds {n:,}: the data "
              f"repeats ({windows / n:.1f} epochs), each epoch in a new order", file=sys.stderr)
    return meta
