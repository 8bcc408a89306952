"""
The token shards `python data.py` writes into a data directory and the loader reads: train.bin and val.bin
(token ids, uint16 or uint32, documents separated by the tokenizer's end-of-document id), meta.json (the
tokenizer and its sha256, vocab size, dtype, special ids, document and token counts) and the tokenizer files.
Reading them, with the checks that belong to the format, lives here, where train.py's start-up checks and the
loader both reach it.
"""

import json
import os

import numpy as np

from support.checkpoint import sha256
from support.tokenizer import SPECIAL_NAMES


def load_meta(data_dir):
    """meta.json of a data directory, once it is complete and its tokenizer.json is the one the shards were made
    with (a copy that differs would go into every checkpoint)."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.isfile(path):
        raise SystemExit(f"{data_dir}: no meta.json; make the shards first with "
                         f"`python data.py --input FILES --tokenizer SPEC --out {data_dir}`")
    with open(path) as f:
        meta = json.load(f)
    missing = [k for k in ("vocab_size", "dtype", *SPECIAL_NAMES) if k not in meta]
    if missing:
        raise SystemExit(f"{path} lacks {', '.join(missing)}: prepare the data again with `python data.py`")
    tok = os.path.join(data_dir, "tokenizer.json")
    if meta.get("tokenizer_sha256") and (not os.path.isfile(tok) or sha256(tok) != meta["tokenizer_sha256"]):
        raise SystemExit(f"{tok} is missing or is not the tokenizer the shards of {data_dir} were made with "
                         "(meta.json records another hash); re-run data.py into a fresh --out")
    return meta


def split_tokens(data_dir, split, meta, seq_len, micro_batch_size, world):
    """The split's tokens (memmapped) and its number of windows of seq_len tokens, once it makes at least one
    micro batch on every rank; else a ValueError that names the fix."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: prepare the data again with `python data.py`")
    tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
    n, need = len(tokens) // seq_len, micro_batch_size * world
    if n < need:
        fix = "prepare the data with a larger --val_docs" if split == "val" else "use more data"
        raise ValueError(f"{path} makes {n} windows of seq_len={seq_len}, fewer than one step needs on every rank "
                         f"(micro_batch_size={micro_batch_size} x world size {world} = {need}); {fix}, or lower "
                         "micro_batch_size or seq_len")
    return tokens, n
