"""support/tokenizer.py: Hugging Face's ids and the files' special ids, on real tokenizers and fuzzed text."""

import os
import random
import unicodedata

import pytest
import tokenizers

from support.tokenizer import load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")
BIOMED = os.path.join(SHARED, "data", "biomed_sentences.txt")
needs_shared = pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED, "tokenizers")),
                                  reason="../shared (real tokenizers and data) is not beside the checkout")


def fuzz_texts():
    """Hand-picked hard cases plus seeded random strings over a mix of scripts and controls."""
    hand = ["", " ", "  ", "a  b", "a" + " " * 30 + "b", " " * 25, "x" + " " * 24 + "y", "\t\ttabs\t \t",
            "trailing   ", "   leading", "line\nbreak\r\n\n  indented", "café", "cafe\u0301", "Ame\u0301lie NFD",
            "\u212b ohm \u2126", "😀 emoji 👩‍👩‍👧 flags 🇫🇷", "中文字符 日本語のテキスト 한국어", "\x00\x01ctrl\x7f\x1f",
            "a [MASK] b", "a  [MASK]b", "[CLS]x[SEP][PAD]", "|||IP_ADDRESS||| and |||EMAIL_ADDRESS|||",
            "<|endoftext|>hi<|padding|>", "I'm we'll they've don't 123 4567 3.14159", "l'homme aujourd’hui qu'il",
            "nbsp\u00a0here\u2028sep\u3000wide", "zero\u200bwidth\ufeffbom", "antidisestablishmentarianismically",
            "Ω≈ç√∫˜µ≤≥÷", "مرحبا بالعالم", "\u0301leading combining", "x" * 300, "🧬" * 5 + "DNA"]
    rng = random.Random(0)
    alphabet = ("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789 .,;:'\"!?-()[]{}<>|\\/@#$%^&*_+=~` \t\n  "
                "éèêàçôûœÉ\u0301\u0300ñüßøåæ ΑΒΓαβγ АБВабв 中文日本 😀🧬👍 \u00a0\u200b\u2028\x00\x07\x1b")
    rand = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80))) for _ in range(200)]
    return hand + rand


def assert_round_trips(tok, texts):
    for t, ids in zip(texts, tok.encode_batch(texts)):  # byte-level BPE loses nothing but the normalisation
        assert tok.tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", t)


@needs_shared
@pytest.mark.parametrize("name,special", [
    ("modernbert", (50281, 50282, 50283, 50284, 50282, 50368)),
    ("camembertv2", (1, 2, 0, 4, 2, 32768))], ids=["modernbert", "camembertv2"])
def test_real_tokenizers_give_their_ids_and_special_ids(name, special):
    """ModernBERT's byte-level BPE and CamemBERTv2's WordPiece: Hugging Face's ids with no [CLS] or [SEP] added, the
    special ids and vocabulary size of their files; ModernBERT's round-trips."""
    with open(BIOMED, encoding="utf-8") as f:
        texts = f.read().splitlines()[:200] + fuzz_texts()
    path = os.path.join(SHARED, "tokenizers", name, "tokenizer.json")
    tok = load_tokenizer(path)
    reference = tokenizers.Tokenizer.from_file(path).encode_batch(texts, add_special_tokens=False)
    assert [t for t, ids, ref in zip(texts, tok.encode_batch(texts), reference) if ids != ref.ids] == []
    assert (tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id, tok.eos_id, tok.vocab_size) == special
    if name == "modernbert":
        assert_round_trips(tok, [t for t in fuzz_texts() if "[" not in t and "|" not in t])  # [MASK] strips a space


def test_trained_bpe_round_trips(tmp_path):
    """train_bpe's byte-level BPE (NFC, GPT-2 pre-tokenization, BERT special tokens) loses nothing but NFC."""
    texts = fuzz_texts()
    path = str(tmp_path / "tokenizer.json")
    train_bpe(iter(texts[:150] + ["The quick brown fox jumps over the lazy dog."] * 50), 600, path)
    tok = load_tokenizer(path)
    assert (tok.pad_id, tok.cls_id, tok.sep_id, tok.mask_id) == (0, 2, 3, 4) and tok.vocab_size == 600
    assert_round_trips(tok, texts)


def test_a_missing_tokenizer_fails_at_once_naming_what_to_give():
    for spec in ("gpt2", "no/such/tokenizer.json"):
        with pytest.raises(FileNotFoundError, match=f"tokenizer '{spec}' not found: give a tokenizer.json"):
            load_tokenizer(spec)
