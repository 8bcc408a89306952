"""Fine-tuning at the model's full context: a long-document task whose label only the end of each document
tells. At the model's max_position_embeddings (the default) the suite learns it; at max_len 512, the old
default, it cannot do better than chance."""

import json
import os
import random
import subprocess
import sys

import torch

from model import ModernBertConfig, ModernBertForMaskedLM
from support.tokenizer import load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILLER = "red green blue cyan magenta yellow black white grey pink".split()
KEYWORD = {"up": "alpha", "down": "omega"}  # the label's word, which appears only after the first 600 tokens


def long_documents(path, tok):
    """1,500-2,000 tokens each: 600-800 filler words, then filler with the label's keyword as one word in 5.
    Every word is one token (checked), so the keyword's first position is the word count before it."""
    rng = random.Random(0)
    os.makedirs(path, exist_ok=True)
    for split, n in (("train", 64), ("validation", 24), ("test", 24)):
        with open(os.path.join(path, f"{split}.jsonl"), "w") as f:
            for k in range(n):
                label = ("up", "down")[k % 2]
                head, length = rng.randint(600, 800), rng.randint(1500, 2000)
                words = [rng.choice(FILLER) for _ in range(head)]
                words += [KEYWORD[label] if rng.random() < 0.2 else rng.choice(FILLER) for _ in range(length - head)]
                words[head] = KEYWORD[label]
                text = " ".join(words)
                ids = tok.encode(text)
                assert len(ids) == length and tok.encode(" ".join(words[:head])) == ids[:head]
                f.write(json.dumps({"text": text, "label": label}) + "\n")


def test_full_context_learns_what_512_tokens_cannot(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    words, rng = FILLER + list(KEYWORD.values()), random.Random(1)
    train_bpe(iter([" ".join(rng.sample(words, len(words))) for _ in range(200)]), 500, str(model / "tokenizer.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=2, local_attention=64, max_position_embeddings=2048,
                                           pad_token_id=0, cls_token_id=2, sep_token_id=3)).save_pretrained(model)
    long_documents(tmp_path / "long", load_tokenizer(str(model)))
    (tmp_path / "suite.py").write_text(
        "seeds = [1]\n"
        "tasks = [dict(name='full', task='cls', data='long', epochs=4, batch_size=8, lr=3e-3),\n"
        "         dict(name='first512', task='cls', data='long', epochs=4, batch_size=8, lr=3e-3, max_len=512)]\n")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--suite", str(tmp_path / "suite.py"),
                        "--models", str(model), "--out", str(tmp_path / "out"), "--device", "cpu"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    tasks = json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]
    full, first = (next(iter(tasks[t]["models"].values())) for t in ("full", "first512"))  # the one model
    assert full["ran_with"] == {"max_len": 2048, "max_tokens": 4096}  # the model's context, CPU's budget
    assert first["ran_with"] == {"max_len": 512, "max_tokens": 4096}
    f1_full, f1_first = full["macro_f1"]["mean"], first["macro_f1"]["mean"]
    print(f"long documents, test macro F1: full context {f1_full:.3f}, first 512 tokens {f1_first:.3f}")
    assert f1_full > 0.9  # the keyword, seen
    assert f1_first < 0.7  # 512 tokens hold filler only: chance (one class for all: 0.333; a coin: ~0.5)
