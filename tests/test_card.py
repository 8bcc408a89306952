"""What an exported checkpoint directory carries for the Hugging Face world: a model card (README.md) whose
numbers are the run's (metrics.jsonl, meta.json, the tokenizer file's sha256), and tokenizer files with which
transformers' own `pipeline("fill-mask")` runs, for a tokenizer trained here (bpe:N) and for copied ones
(../shared/tokenizers), with transformers' ids equal to Hugging Face tokenizers' and its scores our model's."""

import hashlib
import json
import os
import random

import pytest
import tokenizers
import torch
from safetensors.torch import load_file

from data import prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM
from support.checkpoint import checkpoint_problem, save_checkpoint
from test_train import ROOT, TINY, data_dir, metrics, run_train  # noqa: F401 (fixtures)
from train import Config, make_optimizer

SHARED = os.path.join(ROOT, "..", "shared")
TEXT = "the patient was treated with a [MASK] dose."


def front_matter(card):
    """The YAML front matter of a card as {key: value or [items]} (the simple form the card writes)."""
    head = card.split("---\n")[1]
    out, key = {}, None
    for line in head.splitlines():
        if line.startswith("- "):
            out[key].append(line[2:])
        else:
            key, _, value = line.partition(": ")
            key = key.rstrip(":")
            out[key] = value or []
    return out


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def weights(path):
    """The parameter count as stored (the tied decoder weight once, as transformers counts it)."""
    return sum(t.numel() for t in load_file(os.path.join(path, "model.safetensors")).values())


def check_fill_mask(path):
    """transformers' pipeline("fill-mask") on the directory: it knows the special tokens and the maximum length,
    its ids are those of tokenizers itself, and its top scores are our model's softmax at the [MASK]."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.mask_token, tokenizer.pad_token, tokenizer.cls_token, tokenizer.sep_token) == (
        "[MASK]", "[PAD]", "[CLS]", "[SEP]")
    assert tokenizer.model_max_length == ModernBertConfig().max_position_embeddings
    ids = tokenizer(TEXT)["input_ids"]
    reference = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert ids == reference.encode(TEXT).ids
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    results = pipeline("fill-mask", model=path, top_k=3)(TEXT)
    ours = ModernBertForMaskedLM.from_pretrained(path).eval()
    with torch.no_grad():
        probs = ours(torch.tensor([ids]))[0, ids.index(tokenizer.mask_token_id)].softmax(-1)
    top = probs.topk(3)
    assert [r["token"] for r in results] == top.indices.tolist()
    assert [r["score"] for r in results] == pytest.approx(top.values.tolist(), rel=1e-4)
    return results


def test_card_numbers_are_the_runs_and_fill_mask_runs_with_a_trained_tokenizer(data_dir, tmp_path):
    """A tiny run from scratch with a BPE trained here (tokenizer.json alone in the data): every ckpt-*/ and
    final/ has a card with the run's numbers, and pipeline("fill-mask") works on final/."""
    out = tmp_path / "run"
    run_train(out, data_dir, "--decay_frac=0.25", "--ckpt_interval=6", "--eval_interval=6", "--max_ckpts=10")
    records, meta = metrics(out), json.load(open(os.path.join(data_dir, "meta.json")))
    dirs = sorted(out.glob("ckpt-*"), key=lambda d: int(d.name[5:])) + [out / "final"]
    assert [d.name for d in dirs] == ["ckpt-6", "ckpt-12", "ckpt-16", "ckpt-18", "ckpt-20", "final"]
    for d in dirs:
        assert checkpoint_problem(str(d)) is None  # the card and tokenizer files are in the manifest
        card = (d / "README.md").read_text()
        front = front_matter(card)
        assert front["library_name"] == "transformers" and front["pipeline_tag"] == "fill-mask"
        assert "base_model" not in front and {"clm-detour", "pretraining", "clm", "mlm"} <= set(front["tags"])
        step = int(torch.load(d / "train_state.pt", weights_only=False)["step"])
        val = [r for r in records if r["step"] <= step and "val_mlm_loss" in r][-1]
        assert (f"At step {val['step']:,} ({val['phase']} phase, {val['tokens']:,} tokens):" in card
                and f"| {val['val_mlm_loss']:.4f} | {val['val_clm_loss']:.4f} | {val['loss']:.4f} |" in card), card
        assert f"step {step:,} of 20, {step * 512:,} tokens" in card
        # the recipe: 16 CLM steps (warmup 4 steps), 4 MLM-15% decay steps, 512 tokens each, lr 3e-3
        assert "| main | clm | causal | none (next token) | 8,192 | 16 | warmup over 2,048 tokens, then 0.003 |" in card
        assert "| decay | mlm | bidirectional | 15% | 2,048 | 4 | 1-sqrt decay from 0.003 to 0.0003 |" in card
        assert f"{meta['train_tokens']:,} training tokens in {meta['train_docs']:,} documents" in card
        assert f"sha256 {sha256(os.path.join(data_dir, 'tokenizer.json'))}" in card
        assert "seed 17 (init, masking, dropout), data_seed 42 (data order)" in card
        assert f"path = {str(d)!r}" in card and f"{weights(d):,} parameters" in card
    assert card.count("| done |") == 2  # final: both phases
    assert "| 12 of 16 steps |" in (out / "ckpt-12" / "README.md").read_text()
    assert "| not started |" in (out / "ckpt-12" / "README.md").read_text()
    results = check_fill_mask(str(out / "final"))
    print(f"\ntrained bpe: fill-mask top 3 {[(r['token_str'], round(r['score'], 4)) for r in results]}")


@pytest.mark.parametrize("name", ["modernbert", "camembertv2"])
def test_fill_mask_runs_with_a_copied_tokenizer(name, tmp_path):
    """Data prepared with a real tokenizer copied from ../shared (its own tokenizer_config.json travels with it),
    a checkpoint written from it: transformers reads it right (CamemBERTv2's "RobertaTokenizer" class would
    split words into characters), and the card names the hub model init_from came from."""
    source = os.path.join(SHARED, "tokenizers", name)
    if not os.path.isdir(source):
        pytest.skip("../shared (the real tokenizers) is not beside the checkout")
    rng = random.Random(0)
    words = ["patient", "dose", "treated", "tumor", "gene", "protein", "cell", "virus", "the", "a", "with"]
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(60)))
    data = str(tmp_path / "data")
    meta = prepare(lambda: read_documents([str(tmp_path / "corpus.txt")]), source, data, val_docs=10)
    torch.manual_seed(0)
    ids = dict(pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
               bos_token_id=meta["cls_id"], eos_token_id=meta["sep_id"])
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=64 * -(-meta["vocab_size"] // 64), **ids, **TINY))
    init_from = str(tmp_path / "hub" / "models--answerdotai--ModernBERT-base" / "snapshots" / "0123abc")
    c = Config(data_dir=data, out_dir=str(tmp_path / "out"), init_from=init_from, seq_len=64, global_batch_size=8)
    os.makedirs(c.out_dir)
    path = os.path.join(c.out_dir, "ckpt-0")
    save_checkpoint(path, model, make_optimizer(model, c, torch.device("cpu")), {"step": 0, "tokens": 0}, c)
    front = front_matter(open(os.path.join(path, "README.md")).read())
    assert front["base_model"] == "answerdotai/ModernBERT-base" and "continued-pretraining" in front["tags"]
    results = check_fill_mask(path)
    print(f"\n{name}: fill-mask top 3 {[(r['token_str'], round(r['score'], 4)) for r in results]}")
