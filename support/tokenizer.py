"""
The tokenizer: a tokenizer.json on Hugging Face `tokenizers`, its special ids, the companion files transformers reads.
"""

import json
import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from support.files import read_json

SPECIAL_NAMES = ("cls_id", "sep_id", "pad_id", "mask_id", "eos_id")
# The files a Hugging Face tokenizer is read from; they travel with the shards and the checkpoints.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_VOCAB = 1 << 22  # ids: 16 times the largest vocabularies in use (250k); beyond it an id is a file's mistake


def load_tokenizer(spec):
    """spec: a tokenizer.json path, or a directory holding one."""
    path = tokenizer_file(spec)
    if path is None:
        raise FileNotFoundError(f"tokenizer {spec!r} not found: give a tokenizer.json or a directory holding one")
    d = read_json(path)
    try:  # Hugging Face's own reader checks every field of the format
        tok = tokenizers.Tokenizer.from_str(json.dumps(d))
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer.json that Hugging Face tokenizers reads ({e})") from None
    check_companions(os.path.dirname(path))
    return Tokenizer(tok, path)


def tokenizer_file(spec):
    """The tokenizer.json that spec names (the file, or a directory holding one); None if there is none."""
    path = os.path.join(spec, "tokenizer.json") if os.path.isdir(spec) else spec
    return path if os.path.isfile(path) else None


class Tokenizer:
    """A tokenizer.json on Hugging Face `tokenizers` (encode_batch adds no special token), with the special ids of a
    BERT-style vocabulary: cls_id, sep_id, pad_id, mask_id ([CLS] [SEP] [PAD] [MASK]), eos_id ([SEP] ends documents)."""

    def __init__(self, tok, where):
        self.tok = tok
        tokens = ["[CLS]", "[SEP]", "[PAD]", "[MASK]", "[SEP]"]  # of SPECIAL_NAMES
        if missing := [token for token in tokens if tok.token_to_id(token) is None]:
            raise ValueError(f"{where}: the tokenizer has no {missing[0]} token, which MLM training needs")
        self.special_ids = {name: tok.token_to_id(token) for name, token in zip(SPECIAL_NAMES, tokens)}
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may leave gaps
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(f"{where}: ids up to {self.vocab_size - 1:,}, past any vocabulary (at most {MAX_VOCAB:,})")
        vars(self).update(self.special_ids)  # tok.cls_id, tok.sep_id, ...

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]


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
            for key, token in read_json(path).items():
                if key.endswith("_token") and not (isinstance(token, str) or isinstance(token, dict)
                                                   and isinstance(token.get("content"), str)):
                    raise ValueError(f"{path}: {key}={str(token)[:60]} must be a token: a string, or an object "
                                     "with its \"content\"")


def check_vocab(vocab_size, config, tokenizer, model, fix):
    """The tokenizer's ids index the model's embedding, or one line that names both sizes and the fix."""
    if vocab_size > config.vocab_size:
        raise SystemExit(f"vocab mismatch: {tokenizer} has {vocab_size:,} ids but {model} has {config.vocab_size:,} "
                         f"embeddings; {fix}")
