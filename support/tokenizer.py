"""
Tokenizers that give exactly the ids of Hugging Face `tokenizers`, behind one interface:
vocab_size, the special ids, encode / encode_batch (no special tokens added), decode.

load_tokenizer(spec) picks TiktokenBPE for a byte-level BPE tokenizer.json (ModernBERT): on tiktoken, 3-4x faster
than `tokenizers` (tests/test_tokenizer.py checks its ids); else HFTokenizer (WordPiece: ModernCamemBERT) on
`tokenizers` itself. train_bpe trains a byte-level BPE for the offline demo (`--tokenizer bpe:N`).
"""

import json
import os
import re
import unicodedata

import tiktoken
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from support.files import read_json

SPECIAL_NAMES = ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")
# The files a Hugging Face tokenizer is read from; they travel with the shards and the checkpoints.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
NEVER_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}  # bytes a vocabulary may leave out
MAX_VOCAB = 1 << 22  # ids: 16 times the largest vocabularies in use (250k); beyond it an id is a file's mistake
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def load_tokenizer(spec):
    """spec: a tokenizer.json path, or a directory holding one."""
    path = tokenizer_file(spec)
    if path is None:
        raise FileNotFoundError(f"tokenizer {spec!r} not found: give a tokenizer.json or a checkpoint directory "
                                "holding one")
    d = read_json(path)
    try:  # Hugging Face's own reader checks every field of the format
        tok = tokenizers.Tokenizer.from_str(json.dumps(d))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json that Hugging Face tokenizers reads ({e})") from None
    check_companions(os.path.dirname(path))
    return TiktokenBPE(d, tok, path) if _is_gpt2_byte_level_bpe(d) else HFTokenizer(tok, path)


def tokenizer_file(spec):
    """The tokenizer.json that spec names (the file, or a directory holding one); None if there is none."""
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    return path if os.path.isfile(path) else None


class Tokenizer:
    """encode(text) -> ids (no special tokens added), encode_batch, decode, vocab_size, and the special ids of a
    BERT-style vocabulary: cls_id, sep_id, pad_id, mask_id ([CLS] [SEP] [PAD] [MASK]), eos_id ([SEP]: documents
    end with it). tok: the file read by Hugging Face tokenizers; ids: every id the encoder can give (default: tok's)."""

    def __init__(self, tok, where, ids=None):
        self.special_ids = {}
        for name, token in zip(SPECIAL_NAMES, ["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[SEP]"]):
            if tok.token_to_id(token) is None:
                raise ValueError(f"{where}: the tokenizer has no {token} token, which MLM training needs")
            self.special_ids[name] = tok.token_to_id(token)
        self.vocab_size = max(ids or tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may leave gaps
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"{where}: ids up to {self.vocab_size - 1:,}, more than a vocabulary holds (at most "
                             f"{MAX_VOCAB:,})")
        vars(self).update(self.special_ids)  # tok.cls_id, tok.sep_id, ...

    def encode(self, text):
        return self.encode_batch([text])[0]


def _is_gpt2_byte_level_bpe(d):
    m, pre, norm = d.get("model", {}), d.get("pre_tokenizer") or {}, d.get("normalizer")
    return (m.get("type") == "BPE" and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False) and not m.get("ignore_merges", False)
            and m.get("dropout") is None and (norm is None or norm.get("type") == "NFC"))


# GPT-2's bytes_to_unicode inverted: the character that stands for a byte in a vocabulary -> the byte.
# Printable bytes stand for themselves, the others (in order) for chr(256), chr(257), ...
PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
BYTE_OF = {chr(b): b for b in PRINTABLE} | {chr(256 + n): b for n, b in
                                           enumerate(b for b in range(256) if b not in PRINTABLE)}
CHAR_OF = {b: ch for ch, b in BYTE_OF.items()}


def _to_bytes(token):
    return bytes(BYTE_OF[ch] for ch in token)


class TiktokenBPE(Tokenizer):
    """Byte-level BPE from a tokenizer.json on tiktoken, exact to Hugging Face `tokenizers`: the added tokens
    (ModernBERT's runs of 2-24 spaces, [MASK] with lstrip, ...) are split off before BPE, leftmost-longest, in
    Hugging Face's two passes with NFC between them; tiktoken ranks follow the merge order, mapped to the file's ids.
    """

    def __init__(self, d, tok, path):
        vocab = d["model"]["vocab"]
        ranks = {bytes([b]): b for b in range(256)}
        for merge in d["model"]["merges"]:
            a, b = merge.split(" ") if isinstance(merge, str) else merge  # tokenizers checked: two parts
            if not set(a + b) <= BYTE_OF.keys():
                raise ValueError(f"{path}: the merge {merge!r} is not of byte-level BPE tokens")
            ranks.setdefault(_to_bytes(a) + _to_bytes(b), len(ranks))
        self.rank_to_id = [0] * len(ranks)  # the file's id of each tiktoken rank
        for tok_bytes, rank in ranks.items():
            token = "".join(CHAR_OF[x] for x in tok_bytes)
            if token in vocab:
                self.rank_to_id[rank] = vocab[token]
            elif not (len(tok_bytes) == 1 and tok_bytes[0] in NEVER_IN_UTF8):
                raise ValueError(f"{path}: BPE token {token!r} is not in the vocabulary")
        self.tiktoken = tiktoken.Encoding(name=f"hf:{path}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                          special_tokens={})
        added = {a["content"]: a for a in d.get("added_tokens", [])}
        # Hugging Face matches added tokens in two passes: the non-normalized ones (special
        # tokens) on the raw text, then the normalized ones (the space runs) on each
        # remaining piece after normalization.
        self.raw_added, self.normalized_added = [
            AddedTokens({c: a for c, a in added.items() if a.get("normalized", not a.get("special")) == normalized})
            for normalized in (False, True)]
        self.nfc = d.get("normalizer") is not None
        self.id_to_bytes = {i: _to_bytes(t) for t, i in vocab.items() if all(ch in BYTE_OF for ch in t)}
        self.id_to_bytes.update({a["id"]: a["content"].encode() for a in d.get("added_tokens", [])})
        super().__init__(tok, path, [*vocab.values(), *(a["id"] for a in added.values())])  # the file's, as encoded

    def _split(self, text):
        """text -> list of plain strings and added-token ids."""
        out = []
        for p in self.raw_added.split(text):
            if isinstance(p, str):
                out.extend(self.normalized_added.split(unicodedata.normalize("NFC", p) if self.nfc else p))
            else:
                out.append(p)
        return out

    def encode(self, text):
        ids = []
        for p in self._split(text):  # tiktoken's BPE ranks mapped to the file's ids; an added token is its id
            ids += [self.rank_to_id[r] for r in self.tiktoken.encode_ordinary(p)] if isinstance(p, str) else [p]
        return ids

    def encode_batch(self, texts):
        # A plain loop: encode_ordinary_batch's thread pool costs more than it gains on short texts.
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return b"".join(self.id_to_bytes.get(int(i), b"") for i in ids).decode("utf-8", errors="replace")


class AddedTokens:
    """One pass of Hugging Face's added tokens: content -> the tokenizer.json entry (id, lstrip, ...)."""

    def __init__(self, table):
        self.table = table
        self.pattern = re.compile(_trie_pattern(table)) if table else None

    def split(self, text):
        """text -> list of plain strings and added-token ids."""
        parts, pos = [], 0
        for m in (self.pattern.finditer(text) if self.pattern else ()):
            a = self.table[m.group()]
            if a.get("single_word") and not _is_single_word(text, m.start(), m.end()):
                continue
            start, end = m.start(), m.end()
            while a.get("lstrip") and start > pos and _is_ws(text[start - 1]):
                start -= 1
            while a.get("rstrip") and end < len(text) and _is_ws(text[end]):
                end += 1
            if start > pos:
                parts.append(text[pos:start])
            parts.append(a["id"])
            pos = end
        if pos < len(text):
            parts.append(text[pos:])
        return parts


def _trie_pattern(strings):
    """A regex matching any of `strings`, leftmost-longest, built as a character trie so
    that Python's re does not try every alternative at every position."""
    trie = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node):
        alts = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer match first

    return pattern(trie)


def _is_ws(ch):
    """Unicode White_Space, as Hugging Face strips it around added tokens (Python's isspace adds \x1c-\x1f)."""
    return ch.isspace() and ch not in "\x1c\x1d\x1e\x1f"


def _is_single_word(text, start, end):
    word = lambda i: 0 <= i < len(text) and (text[i].isalnum() or text[i] == "_")  # noqa: E731
    return not word(start - 1) and not word(end)


class HFTokenizer(Tokenizer):
    """Any other tokenizer.json (WordPiece for ModernCamemBERT) on Hugging Face `tokenizers` itself."""

    def __init__(self, tok, path):
        self.tok = tok
        super().__init__(tok, path)

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def train_bpe(texts, vocab_size, path):
    """Train a byte-level BPE (GPT-2 pre-tokenization, NFC, BERT special tokens) and write tokenizer.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(path)


def write_hf_config(directory, model_max_length):
    """Beside directory/tokenizer.json, tokenizer_config.json and special_tokens_map.json naming its special tokens
    and the model's maximum length: without them AutoTokenizer knows no [MASK] (a `bpe:N` tokenizer ships
    tokenizer.json alone) and pipeline("fill-mask") fails. A copied tokenizer's own files are kept, completed."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return  # the data directory had no tokenizer to copy
    tok = tokenizers.Tokenizer.from_file(path)
    # the tokens load_tokenizer takes as special (Tokenizer); documents end with [SEP]
    special = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]",
               "bos_token": "[CLS]", "eos_token": "[SEP]", "unk_token": "[UNK]"}
    special = {name: token for name, token in special.items() if tok.token_to_id(token) is not None}
    config_file = os.path.join(directory, "tokenizer_config.json")
    config = read_json(config_file) if os.path.isfile(config_file) else {}  # check_companions: its shape
    # tokenizer.json is the tokenizer, whatever class a copied config names: transformers 5 builds a
    # "RobertaTokenizer" (CamemBERTv2's) anew from its vocabulary and splits words into characters.
    config = {"clean_up_tokenization_spaces": False, **special, **{k: v for k, v in config.items() if v is not None},
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length}
    if type(tok.model).__name__ == "BPE":  # the clean-up drops the spaces a byte-level BPE keeps (" ." -> ".")
        config["clean_up_tokenization_spaces"] = False
    files = {"tokenizer_config.json": config}
    if not os.path.isfile(os.path.join(directory, "special_tokens_map.json")):  # a copied one's is kept as it is
        files["special_tokens_map.json"] = {name: config[name] for name in special}
    for name, obj in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)


def check_companions(directory):
    """tokenizer_config.json and special_tokens_map.json in `directory`, where they are, hold their special tokens
    (`*_token` keys) as transformers reads them; else a ValueError naming the file and the key."""
    for name in TOKENIZER_FILES[1:]:
        path = os.path.join(directory, name)
        if os.path.lexists(path):
            d = read_json(path)
            for key, token in d.items():
                if key.endswith("_token") and not (isinstance(token, str) or isinstance(token, dict)
                                                   and isinstance(token.get("content"), str)):
                    raise ValueError(f"{path}: {key}={str(token)[:60]} must be a token: a string, or an object "
                                     "with its \"content\"")


def check_vocab(vocab_size, config, tokenizer, model, fix):
    """The tokenizer's ids index the model's embedding, or one line that names both sizes and the fix."""
    if vocab_size > config.vocab_size:
        raise SystemExit(f"vocab mismatch: {tokenizer} has {vocab_size:,} ids but {model} has {config.vocab_size:,} "
                         f"embeddings; {fix}")
