"""
The paper's baseline rows: any other Hugging Face encoder (BERT, RoBERTa / CamemBERT, ELECTRA, DeBERTa, ...),
fine-tuned by eval.py under the same protocol as a ModernBERT checkpoint, through transformers'
AutoModelForSequenceClassification / AutoModelForTokenClassification and the directory's own fast tokenizer.

eval.py keeps one training loop for both: it hands a model flat tokens with cu_seqlens (the unpadded layout of
model.py) and reads back logits, one row per sequence (cls, multilabel) or per token (ner), then takes the same
summed loss, micro batches and optimizer. `Padded` below is the one adaptor: it lays a micro batch out as the
(B, S) padded batch and attention mask transformers takes, and the logits back out flat. What differs between
families is handled here:
- the maximum length: each model's own (`max_len`: 512 for the BERTs);
- special tokens: the tokenizer's own ([CLS] x [SEP], <s> x </s>), truncation as for ModernBERT (the first
  max_len tokens of a text, the special tokens kept); NER sentences split at word boundaries by eval.py;
- NER labels on each word's first sub-token, found through the tokenizer's word ids (the words given
  pre-split, as transformers' token-classification recipe does: a byte-level BPE then marks every word as
  following a space, as it would be in running text);
- the classification head (pooling included) is the family's own, as transformers defines it;
- padding: its pad id is the model's own (RoBERTa derives position ids from it), and a micro batch's token
  budget counts the padded batch (eval.micro_batches).

transformers is imported here only, and only for a model that is not ModernBERT: a ModernBERT-only user never
needs it.
"""

import contextlib
import os

import torch
from torch import nn

from model import PreTrained
from support.files import read_json
from support.tokenizer import check_vocab

INSTALL = "pip install transformers"
PROBE = "The tumour grows; IL-2 levels rose in 3 of 10 patients."  # a text to compare two tokenizers on
PROBE_WORDS = ["the", "tumour", "grows", "slowly"]  # words to compare pre-split and running-text sub-tokens on


def is_modernbert(path):
    """True unless the directory's config.json names another model_type; a missing or unreadable config.json is
    left to the ModernBERT checks, which say what is wrong with it."""
    try:
        model_type = read_json(os.path.join(path, "config.json")).get("model_type", "modernbert")
    except (OSError, ValueError):
        return True
    return model_type == "modernbert" or not isinstance(model_type, str)  # no name: the ModernBERT checks say so


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


# -----------------------------------------------------------------------------
# The checks before any training


def check_encoder(path, where):
    """-> (its Tokenizers, what the table records of it: family, max_len, code path), once the directory loads
    as a transformers encoder with a classification head for every task type, weights that fill its encoder,
    and a fast tokenizer that fits its embedding; else one line that says what is missing."""
    model_type = read_json(os.path.join(path, "config.json"))["model_type"]  # is_modernbert: it has another

    def refuse(problem):
        raise SystemExit(f"{where}: config.json has model_type={model_type!r}; this code only reads ModernBERT "
                         "checkpoints itself, and another encoder through transformers (a directory with its "
                         f"weights and a fast tokenizer), which {problem}")

    try:
        import transformers
    except ImportError:
        refuse(f"is not installed: {INSTALL}")
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
        missing = sorted(k for k in info["missing_keys"] if k.startswith(model.base_model_prefix + ".")
                         and ".pooler." not in k)
        if missing:
            refuse(f"finds no weights for its encoder's {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        tok = load_tokenizers(path, refuse)
    check_vocab(len(tok.text), model.config, f"the tokenizer of {path}", where, "give the model its own tokenizer")
    return tok, {"family": model_type, "max_len": max_length(model, tok.text),
                 "code": f"transformers {heads['sequence']} / {heads['token']}, padded batches, attention "
                         f"{model.config._attn_implementation}"}


def max_length(model, tokenizer):
    """The longest input the model takes, special tokens included: its position embeddings, less the
    offset of the families whose position ids count from the pad id + 1 (RoBERTa, CamemBERT: 514 -> 512),
    and at most the tokenizer's model_max_length where it gives one."""
    positions = model.config.max_position_embeddings
    pad = getattr(model.base_model.embeddings, "padding_idx", None)  # set by those families' embeddings only
    if pad is not None:
        positions -= pad + 1
    return min(positions, tokenizer.model_max_length)


class Tokenizers:
    """The model's fast tokenizer twice: `text` as the family runs it on running text (classification), `words`
    as it runs on words given pre-split (NER; add_prefix_space for a byte-level BPE)."""

    def __init__(self, text, words):
        self.text, self.words = text, words

    def texts(self, texts, max_len):
        """-> the ids of each text with the tokenizer's special tokens, truncated to max_len tokens."""
        return self.text(texts, truncation=True, max_length=max_len)["input_ids"]

    def sentences(self, sentences):
        """Lists of words -> per sentence (the special ids before its words, each word's sub-token ids, those
        after), through the tokenizer's word ids. A word the tokenizer drops (a lone control character) stands
        as the unknown token, so that it keeps its label and its place."""
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
    """The directory's fast tokenizer, checked: transformers builds it as its tokenizer.json encodes (transformers
    5 rebuilds some classes from their vocabulary, e.g. CamemBERTv2's 'RobertaTokenizer' as a character-level BPE:
    then tokenizer.json is taken as it is), and pre-split words get the sub-tokens they have in running text."""
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


# -----------------------------------------------------------------------------
# The model


class Padded(nn.Module):
    """A transformers classifier behind the call eval.py makes of model.py's: flat tokens (T,) with cu_seqlens
    in, logits out, (B, num_labels) per sequence or (T, num_labels) per token; inside, the (B, S) padded batch
    and its attention mask. Padded with the model's pad id: RoBERTa's position ids count the tokens that are not
    it (so a pad of another id would shift nothing but could index past the position table)."""

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
    """The transformers classifier of the directory for `task`, its new head initialised from torch's RNG
    (eval.py seeds it), in float32 whatever dtype the weights are stored in, and in training mode (dropout on):
    as model.py's classifiers come, where transformers' from_pretrained gives evaluation mode."""
    import transformers
    auto = (transformers.AutoModelForTokenClassification if task == "ner"
            else transformers.AutoModelForSequenceClassification)
    with quiet(transformers):
        hf = auto.from_pretrained(path, id2label=id2label, label2id={v: int(k) for k, v in id2label.items()},
                                  problem_type=problem_type)
    return Padded(hf.float(), per_token=task == "ner").train()
