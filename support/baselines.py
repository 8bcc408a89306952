"""
The baseline rows of eval.py's table: other Hugging Face encoders, fine-tuned through transformers.

Any encoder (BERT, RoBERTa / CamemBERT, ELECTRA, DeBERTa, ...) is fine-tuned by eval.py under the same protocol, in
its one training loop, through transformers' AutoModelFor{Sequence,Token}Classification and the directory's own fast
tokenizer. What differs between families is kept here: the maximum length (512 for the BERTs), the special tokens,
NER labels on each word's first sub-token (through the tokenizer's word ids), the classification head, the pad id.
"""

import contextlib
import os

import torch
from torch import nn

from model import PreTrained
from support.files import read_json
from support.tokenizer import check_vocab

PROBE = "The tumour grows; IL-2 levels rose in 3 of 10 patients."  # a text to compare two tokenizers on
PROBE_WORDS = ["the", "tumour", "grows", "slowly"]  # words to compare pre-split and running-text sub-tokens on


def is_modernbert(path):
    """True unless config.json names another model_type (a missing or bad one: the ModernBERT checks say so)."""
    try:
        model_type = read_json(os.path.join(path, "config.json")).get("model_type", "modernbert")
    except (OSError, ValueError):
        return True
    return model_type == "modernbert" or not isinstance(model_type, str)


@contextlib.contextmanager
def quiet(transformers):
    """transformers without its load report and progress bars (a new classifier is 'missing' by design)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()


def one_line(e):
    return " ".join(str(e).split())


def check_encoder(path, where):
    """-> (its Tokenizers, what the table records of it), once the directory loads as a transformers encoder with
    both classification heads, weights that fill its encoder and a fast tokenizer that fits its embedding."""
    model_type = read_json(os.path.join(path, "config.json"))["model_type"]  # is_modernbert: it has another

    def refuse(problem):
        raise SystemExit(f"{where}: config.json has model_type={model_type!r}; this code only reads ModernBERT "
                         "checkpoints itself, and another encoder through transformers (a directory with its "
                         f"weights and a fast tokenizer), which {problem}")

    try:
        import transformers
    except ImportError:
        refuse("is not installed: pip install transformers")
    from transformers.models.auto import modeling_auto as auto
    heads = {"sequence": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type),
             "token": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(model_type)}
    if not all(heads.values()):
        refuse(f"has no {' or '.join(k for k, v in heads.items() if not v)} classification head for it")
    with quiet(transformers):
        try:
            model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=2, output_loading_info=True)
        except (OSError, ValueError, RuntimeError) as e:  # no weights, weights of other shapes, a bad config
            refuse(f"cannot load it: {one_line(e)}")
        # Only the task head may be new: an encoder weight the checkpoint lacks would be trained from random.
        # (BERT's pooler is the head's first layer: an MLM-only checkpoint has none, as in transformers.)
        if missing := sorted(k for k in info["missing_keys"] if k.startswith(model.base_model_prefix + ".")
                             and ".pooler." not in k):
            refuse(f"finds no weights for its encoder's {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        tok = load_tokenizers(path, refuse)
    check_vocab(len(tok.text), model.config, f"the tokenizer of {path}", where, "give the model its own tokenizer")
    # The longest input: the positions, less pad id + 1 where position ids count from there (RoBERTa, CamemBERT:
    # 514 -> 512), at most the tokenizer's model_max_length.
    pad = getattr(model.base_model.embeddings, "padding_idx", None)  # set by those families' embeddings only
    positions = model.config.max_position_embeddings - (0 if pad is None else pad + 1)
    return tok, {"family": model_type, "max_len": min(positions, tok.text.model_max_length),
                 "code": f"transformers {heads['sequence']} / {heads['token']}, padded batches, attention "
                         f"{model.config._attn_implementation}"}


class Tokenizers:
    """The fast tokenizer twice: `text` for running text (classification), `words` for words given pre-split (NER;
    add_prefix_space for a byte-level BPE)."""

    def __init__(self, text, words):
        self.text, self.words = text, words

    def texts(self, texts, max_len):
        return self.text(texts, truncation=True, max_length=max_len)["input_ids"]

    def sentences(self, sentences):
        """Lists of words -> per sentence (the special ids before, each word's sub-token ids, those after). A word
        the tokenizer drops (a lone control character) stands as the unknown token: it keeps its label and place."""
        enc = self.words(sentences, is_split_into_words=True)
        unk = self.words.unk_token_id if self.words.unk_token_id is not None else self.words.mask_token_id
        out = []
        for s, words in enumerate(sentences):
            ids, word_ids = enc["input_ids"][s], enc.word_ids(s)
            inside = [k for k, w in enumerate(word_ids) if w is not None]
            pieces = [[] for _ in words]
            for k in inside:
                pieces[word_ids[k]].append(ids[k])
            out.append((ids[:inside[0]] if inside else ids, [p or [unk] for p in pieces],
                        ids[inside[-1] + 1:] if inside else []))
        return out


def load_tokenizers(path, refuse):
    """The directory's fast tokenizer, checked: it encodes as its tokenizer.json does (transformers 5 rebuilds some
    classes from their vocabulary, e.g. CamemBERTv2's as a character-level BPE: then tokenizer.json is taken as it
    is), and pre-split words get the sub-tokens they have in running text."""
    import tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        text = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        refuse(f"cannot load its tokenizer: {one_line(e)}")
    if not text.is_fast:
        refuse(f"needs a fast tokenizer (its word ids place the NER labels); {type(text).__name__} is not one")
    file = os.path.join(path, "tokenizer.json")
    if os.path.isfile(file) and text(PROBE)["input_ids"] != tokenizers.Tokenizer.from_file(file).encode(PROBE).ids:
        text = PreTrainedTokenizerFast.from_pretrained(path)
    words = type(text).from_pretrained(path, add_prefix_space=True)
    running = text(" ".join(PROBE_WORDS))
    split = words(PROBE_WORDS, is_split_into_words=True)
    of_word = lambda enc, w: [i for i, k in zip(enc["input_ids"], enc.word_ids()) if k == w]  # noqa: E731
    if any(of_word(running, w) != of_word(split, w) for w in range(1, len(PROBE_WORDS))):  # the first has no space
        refuse(f"gives words pre-split other sub-tokens than in running text ({type(text).__name__}: a byte-level "
               "BPE needs add_prefix_space, which this class ignores); NER labels would sit on other tokens")
    return Tokenizers(text, words)


class Padded(nn.Module):
    """A transformers classifier behind model.py's call: flat tokens (T,) with cu_seqlens in, logits (B, L) or
    (T, L) out; inside, the (B, S) batch padded with the model's pad id (RoBERTa's position ids count the tokens
    that are not it: another id could index past the position table)."""

    def __init__(self, hf, per_token):
        super().__init__()
        self.hf, self.per_token = hf, per_token
        self.pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def forward(self, input_ids, *, cu_seqlens, max_seqlen):
        lengths = cu_seqlens.diff()  # (B,)
        mask = torch.arange(max_seqlen, device=input_ids.device) < lengths[:, None]  # (B, S)
        ids = input_ids.new_full(mask.shape, self.pad_id)
        ids[mask] = input_ids  # row by row, in the flat order
        logits = self.hf(input_ids=ids, attention_mask=mask.long()).logits  # (B, L) or (B, S, L)
        return logits[mask] if self.per_token else logits  # (T, L) in the flat order, or (B, L)

    # AdamW groups by model.py's rule: weight decay on the matrices, none on biases and norm weights (for these
    # families the very parameters the Hugging Face Trainer exempts: its 'bias' and LayerNorm weights).
    param_groups = PreTrained.param_groups

    def save_pretrained(self, path):
        self.hf.save_pretrained(path)


def classifier(path, task, id2label, problem_type):
    """The directory's transformers classifier for `task`, its new head from torch's RNG (eval.py seeds it), in
    float32 and in training mode, as model.py's come (transformers' from_pretrained gives evaluation mode)."""
    import transformers
    auto = (transformers.AutoModelForTokenClassification if task == "ner"
            else transformers.AutoModelForSequenceClassification)
    with quiet(transformers):
        hf = auto.from_pretrained(path, id2label=id2label, label2id={v: int(k) for k, v in id2label.items()},
                                  problem_type=problem_type)
    return Padded(hf.float(), per_token=task == "ner").train()
