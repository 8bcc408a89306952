"""The baseline rows (support/baselines.py): Hugging Face encoders fine-tuned by eval.py under a ModernBERT
checkpoint's protocol. A tiny BERT (WordPiece) and RoBERTa (byte-level BPE) made here on ../shared text, checked
against sub-token alignment written out by hand and transformers' own models, batches and losses; and our
ModernBERT path against transformers' ModernBERT classes, so that both paths share one table."""

import copy
import itertools
import json
import os
import random
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")
SENTENCES = os.path.join(SHARED, "biomed_sentences.txt")
pytestmark = pytest.mark.skipif(not os.path.isfile(SENTENCES), reason="../shared/data is not beside the checkout")
transformers = pytest.importorskip("transformers")

import eval  # noqa: E402
from model import ModernBertConfig, ModernBertForMaskedLM  # noqa: E402
from support import baselines  # noqa: E402
from support.tokenizer import train_bpe  # noqa: E402
from test_suite import conll_slice, jsonl_slice  # noqa: E402

CPU, FLOAT32 = torch.device("cpu"), torch.float32
FAMILIES = {"modernbert": (8192, "model.py ModernBertForSequenceClassification"),  # maximum length, what runs it
            "bert": (64, "transformers BertForSequenceClassification"),
            "roberta": (64, "transformers RobertaForSequenceClassification")}
TINY = dict(vocab_size=600, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def texts(n=4000):
    with open(SENTENCES, encoding="utf-8") as f:
        return [line.strip() for line in itertools.islice(f, n)]


def make_hf(path, family):
    """A tiny random BERT (WordPiece) or RoBERTa (byte-level BPE, 66 positions: its position ids start at pad + 1)
    with a tokenizer trained here, and its tokenizer.json as on the hub."""
    from tokenizers.implementations import BertWordPieceTokenizer, ByteLevelBPETokenizer
    if family == "bert":
        tok, special, config = BertWordPieceTokenizer(lowercase=True), {}, transformers.BertConfig(
            **TINY, max_position_embeddings=64)
    else:
        tok, special = ByteLevelBPETokenizer(), dict(special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
        config = transformers.RobertaConfig(**TINY, max_position_embeddings=66, pad_token_id=1, bos_token_id=0,
                                            eos_token_id=2)
    tok.train_from_iterator(texts(), vocab_size=600, min_frequency=2, **special)
    os.makedirs(path)
    tok.save_model(str(path))  # vocab.txt, or vocab.json and merges.txt: what transformers' slow classes read
    torch.manual_seed(0)
    transformers.AutoModelForMaskedLM.from_config(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(path)


def make_modernbert(path):
    os.makedirs(path)
    train_bpe(iter(texts()), 600, str(path / "tokenizer.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=600, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                           num_attention_heads=2, local_attention=8, pad_token_id=0, cls_token_id=2,
                                           sep_token_id=3, bos_token_id=2, eos_token_id=3)).save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    make_hf(tmp / "bert", "bert")
    make_hf(tmp / "roberta", "roberta")
    make_modernbert(tmp / "modernbert")
    return tmp


SENTENCE = {"tokens": ["The", "cells", "\x07", "xqzv", "IL-2"], "tags": ["O", "B-DIS", "O", "I-DIS", "O"]}
TAGS = ["O", "B-DIS", "I-DIS"]  # ids 0, 1, 2
# By hand from each tokenizer's rules: BERT lower-cases, splits IL-2 at its punctuation and drops the control
# character (an [UNK] keeping its label); the byte-level BPE puts a space before every word (add_prefix_space),
# keeps the control character as a byte and has no "ĠThe". The tag sits on each word's first sub-token.
BY_HAND = {
    "bert": ([("[CLS]", -100), ("the", 0), ("cells", 1), ("[UNK]", 0), ("x", 2), ("##q", -100), ("##z", -100),
              ("##v", -100), ("i", 0), ("##l", -100), ("-", -100), ("2", -100), ("[SEP]", -100)],
             # at max_len 6 (4 sub-tokens between [CLS] and [SEP]) the sentence is cut between words
             [[("[CLS]", -100), ("the", 0), ("cells", 1), ("[UNK]", 0), ("[SEP]", -100)],
              [("[CLS]", -100), ("x", 2), ("##q", -100), ("##z", -100), ("##v", -100), ("[SEP]", -100)],
              [("[CLS]", -100), ("i", 0), ("##l", -100), ("-", -100), ("2", -100), ("[SEP]", -100)]],
             [[(0, 0), (0, 1), (0, 2)], [(0, 3)], [(0, 4)]]),
    "roberta": ([("<s>", -100), ("Ġ", 0), ("The", -100), ("Ġcells", 1), ("Ġ", 0), ("ć", -100), ("Ġ", 2), ("x", -100),
                 ("q", -100), ("z", -100), ("v", -100), ("ĠI", 0), ("L", -100), ("-", -100), ("2", -100),
                 ("</s>", -100)],
                # at max_len 6 a word longer than 4 sub-tokens keeps its first 4, as for ModernBERT
                [[("<s>", -100), ("Ġ", 0), ("The", -100), ("Ġcells", 1), ("</s>", -100)],
                 [("<s>", -100), ("Ġ", 0), ("ć", -100), ("</s>", -100)],
                 [("<s>", -100), ("Ġ", 2), ("x", -100), ("q", -100), ("z", -100), ("</s>", -100)],
                 [("<s>", -100), ("ĠI", 0), ("L", -100), ("-", -100), ("2", -100), ("</s>", -100)]],
                [[(0, 0), (0, 1)], [(0, 2)], [(0, 3)], [(0, 4)]]),
}


@pytest.mark.parametrize("family,cls,sep", [("bert", "[CLS]", "[SEP]"), ("roberta", "<s>", "</s>")])
def test_each_family_has_its_own_first_sub_tokens_maximum_length_and_special_tokens(models, family, cls, sep):
    tok, about = eval.check_model(str(models / family), None, CPU, FLOAT32)
    whole, pieces, where = BY_HAND[family]
    convert = tok.words.convert_tokens_to_ids
    (ids, target), = eval.encode_examples([SENTENCE], tok, "ner", TAGS, about["max_len"])["items"]
    assert (ids, target) == (convert([t for t, _ in whole]), [y for _, y in whole])
    split = eval.encode_examples([SENTENCE], tok, "ner", TAGS, 6)
    assert split["items"] == [(convert([t for t, _ in p]), [y for _, y in p]) for p in pieces]
    assert split["where"] == where
    # max_len: the longest input transformers' own model takes; a longer text keeps its first max_len - 2 tokens
    assert about["max_len"] == 64 and about["family"] == family and about["code"].startswith("transformers ")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(models / family).eval()
    with torch.no_grad():
        hf(input_ids=torch.full((1, 64), 5))
        with pytest.raises((IndexError, RuntimeError)):
            hf(input_ids=torch.full((1, 65), 5))
    text = " ".join(texts(40)[20:40])
    plain = tok.text(text, add_special_tokens=False)["input_ids"]
    assert len(plain) > 64
    (ids, _), = eval.encode_examples([{"text": text, "label": "a"}], tok, "cls", ["a"], 64)["items"]
    assert ids == tok.text.convert_tokens_to_ids([cls]) + plain[:62] + tok.text.convert_tokens_to_ids([sep])


def test_refused_before_training_with_what_is_missing(models, tmp_path, monkeypatch):
    # (a BERT without weights: in the suite's refusal below)
    torch.manual_seed(0)  # a classifier saved with its encoder under another name: the encoder would be random
    hf = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY, max_position_embeddings=64))
    state = {k.replace("bert.encoder.", "encoder_renamed."): v for k, v in hf.state_dict().items()}
    hf.save_pretrained(tmp_path / "renamed", state_dict=state)
    transformers.AutoTokenizer.from_pretrained(models / "bert").save_pretrained(tmp_path / "renamed")
    with pytest.raises(SystemExit, match=r"finds no weights for its encoder's bert\.encoder\.layer\.0\."):
        eval.check_model(str(tmp_path / "renamed"), None, CPU, FLOAT32)

    # a byte-level BPE as a generic PreTrainedTokenizerFast, which ignores add_prefix_space
    generic = transformers.PreTrainedTokenizerFast(tokenizer_file=str(models / "roberta" / "tokenizer.json"),
                                                   bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    os.makedirs(tmp_path / "generic")
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "generic" / name).write_bytes((models / "roberta" / name).read_bytes())
    generic.save_pretrained(tmp_path / "generic")
    with pytest.raises(SystemExit, match="gives words pre-split other sub-tokens than in running text"):
        eval.check_model(str(tmp_path / "generic"), None, CPU, FLOAT32)

    with pytest.raises(SystemExit, match="a bert model is fine-tuned with its own tokenizer"):  # not ignored
        eval.main(["--model", str(models / "bert"), "--tokenizer", str(models / "modernbert"), "--task", "cls",
                   "--data", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "out")])

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(SystemExit, match=r"^--model \S+: config.json has model_type='bert'; .*is not installed: "
                                         r"pip install transformers$"):
        eval.check_model(str(models / "bert"), None, CPU, FLOAT32)


def task_examples(task, n=12, seed=0):
    """(examples, labels) from the shared sentences cut to 3-25 words: classes and labels by keywords, random tags."""
    rng = random.Random(seed)
    pool = [" ".join(s.split()[:rng.randint(3, 25)]) for s in texts(400)[seed * 100:]]  # of various lengths
    if task == "cls":
        return [{"text": s, "label": ("protein" in s) + ("cell" in s)} for s in pool[:n]], ["0", "1", "2"]
    if task == "multilabel":
        keys = ["and", "of", "the"]
        return [{"text": s, "labels": [k for k in keys if k in s.lower().split()]} for s in pool[:n]], keys
    tag = random.Random(seed)
    return [{"tokens": s.split(), "tags": [tag.choice(TAGS) for _ in s.split()]} for s in pool[:n]], TAGS


def reference_batch(items, task, pad_id):
    """The padded batch as transformers' users build it: right-padded, labels as its losses take them."""
    width = max(len(x) for x, _ in items)
    ids = torch.tensor([x + [pad_id] * (width - len(x)) for x, _ in items])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x, _ in items])
    if task == "ner":
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in items])
    else:
        labels = torch.tensor([y for _, y in items], dtype=torch.float32 if task == "multilabel" else torch.long)
    return ids, mask, labels


def flat_logits(model, items, task):
    flat, _ = eval.flat_batch(items, task, CPU)
    return model(flat.tokens, cu_seqlens=flat.cu_seqlens, max_seqlen=flat.max_seqlen)


@pytest.mark.parametrize("task", ["cls", "multilabel", "ner"])
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_padded_path_equals_transformers_own_forward_and_loss(models, family, task):
    tok, _ = eval.check_model(str(models / family), None, CPU, FLOAT32)
    examples, labels = task_examples(task)
    items = eval.encode_examples(examples, tok, task, labels, 64)["items"]
    assert len({len(x) for x, _ in items}) > 3  # the batch is padded
    torch.manual_seed(0)
    model = eval.classifier(eval.argparse.Namespace(model=str(models / family), task=task, pooling="mean"), labels)
    assert isinstance(model, baselines.Padded)
    assert all(m.training for m in model.modules())  # dropout on for training (transformers loads in eval mode)
    model.eval()  # dropout off: both forwards see the same network
    ids, mask, targets = reference_batch(items, task, tok.text.pad_token_id)
    with torch.no_grad():
        ref = model.hf(input_ids=ids, attention_mask=mask, labels=targets)
        ours = eval.task_loss_sum(model, items, task, CPU) / eval.count_targets(items, task, len(labels))
        logits = flat_logits(model, items, task)
    torch.testing.assert_close(logits, ref.logits[mask.bool()] if task == "ner" else ref.logits, rtol=0, atol=1e-5)
    assert ours.item() == pytest.approx(ref.loss.item(), rel=1e-6)


def test_padded_micro_batches_make_the_update_of_one_batch(models):
    # float64; each micro batch's padded size (rows x longest) within the budget
    tok, _ = eval.check_model(str(models / "bert"), None, CPU, FLOAT32)
    examples, labels = task_examples("cls", n=16, seed=1)
    items = eval.encode_examples(examples, tok, "cls", labels, 64)["items"]
    parts = eval.micro_batches(items, 96, padded=True)
    assert len(parts) > 4 and all(len(p) * max(len(x) for x, _ in p) <= 96 or len(p) == 1 for p in parts)
    assert len(eval.micro_batches(items, 96)) < len(parts)  # counting unpadded tokens would pack more
    torch.manual_seed(0)
    base = eval.classifier(eval.argparse.Namespace(model=str(models / "bert"), task="cls", pooling="mean"), labels)
    base = base.double().eval()  # dropout off: two passes must see one network

    def grads(budget):
        model = copy.deepcopy(base)
        eval.accumulate(model, items, "cls", CPU, 1 / len(items), budget, torch.autocast("cpu", enabled=False),
                        padded=True)
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads(10 ** 6), grads(96)):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-15)


# -----------------------------------------------------------------------------
# End to end through eval.py: classification, multi-label and NER for both families


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Slices of GAD and NCBI-disease, multi-label from the shared sentences, and two tasks separable by words."""
    tmp = tmp_path_factory.mktemp("tasks")
    for name in ("gad", "ncbi_disease", "multilabel", "separable", "separable_ner"):
        (tmp / name).mkdir()
    for split, n in (("train", 48), ("devel", 16), ("test", 16)):
        jsonl_slice(os.path.join(SHARED, "gad", f"{split}.jsonl"), tmp / "gad" / f"{split}.jsonl", n)
        conll_slice(os.path.join(SHARED, "ncbi_disease", f"{split}.tsv"), tmp / "ncbi_disease" / f"{split}.tsv", n)
    examples, _ = task_examples("multilabel", n=80, seed=2)
    for split, part in (("train", examples[:48]), ("devel", examples[48:64]), ("test", examples[64:])):
        (tmp / "multilabel" / f"{split}.jsonl").write_text("".join(json.dumps(ex) + "\n" for ex in part))
    rng = random.Random(0)
    warm, cold = ["protein", "gene", "receptor", "kinase"], ["cell", "tissue", "liver", "tumor"]
    for split, n in (("train", 96), ("devel", 24), ("test", 24)):
        with open(tmp / "separable" / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                label = rng.choice(["warm", "cold"])
                words = [rng.choice(warm if label == "warm" else cold) for _ in range(rng.randint(3, 10))]
                f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
        with open(tmp / "separable_ner" / f"{split}.jsonl", "w") as f:  # one family's words are entities
            for _ in range(n):
                words = [rng.choice(warm + cold) for _ in range(rng.randint(3, 10))]
                f.write(json.dumps({"tokens": words, "tags": ["B-X" if w in warm else "O" for w in words]}) + "\n")
    return tmp


@pytest.mark.parametrize("family,task,data", [("bert", "cls", "separable"), ("roberta", "ner", "separable_ner")])
def test_a_task_separable_by_its_words_is_learned(models, tasks, tmp_path, family, task, data):
    # 4 epochs take a tiny random model from chance to a task separable by its words (every family x task runs
    # end to end in the suite below)
    eval.main(["--model", str(models / family), "--task", task, "--data", str(tasks / data), "--seeds", "3",
               "--epochs", "4", "--lr", "3e-3", "--out", str(tmp_path / "learn"), "--device", "cpu"])
    assert json.loads((tmp_path / "learn" / "results.json").read_text())["summary"]["macro_f1"]["mean"] > 0.9


# -----------------------------------------------------------------------------
# One table: a ModernBERT checkpoint beside a BERT and a RoBERTa, on every kind of task


def test_suite_checks_every_model_then_puts_modernbert_bert_and_roberta_in_one_table(models, tasks, tmp_path):
    np = pytest.importorskip("numpy")
    (tmp_path / "no_weights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "no_weights" / name).write_bytes((models / "bert" / name).read_bytes())
    (tmp_path / "bad.py").write_text(f"seeds = [1]\ntasks = [dict(name='gad', task='cls', "
                                     f"data={str(tasks / 'gad')!r}, max_len=128)]\n")
    with pytest.raises(SystemExit) as e:
        eval.main(["--suite", str(tmp_path / "bad.py"), "--models", str(models / "modernbert"),
                   str(tmp_path / "no_weights"), str(models / "roberta"), "--out", str(tmp_path / "out"),
                   "--device", "cpu"])
    assert "nothing was trained" in str(e.value)
    assert re.search(r"no_weights: config.json has model_type='bert'; this code only reads ModernBERT .* cannot load",
                     str(e.value))
    assert "max_len=128 is beyond the model's 64 positions" in str(e.value)  # the RoBERTa's own maximum
    assert not (tmp_path / "out").exists()

    (tmp_path / "suite.py").write_text("seeds = [1, 2]\ntasks = [" + ", ".join(
        f"dict(name={name!r}, task={task!r}, data={str(tasks / data)!r}, epochs=1, lr=5e-3)"
        for name, task, data in (("gad", "cls", "gad"), ("multilabel", "multilabel", "multilabel"),
                                 ("ncbi", "ner", "ncbi_disease"))) + "]\n")
    eval.main(["--suite", str(tmp_path / "suite.py"), "--models", *(str(models / m) for m in FAMILIES),
               "--out", str(tmp_path / "out"), "--device", "cpu"])
    res, md = json.loads((tmp_path / "out" / "results.json").read_text()), (tmp_path / "out" / "results.md").read_text()
    names = list(res["models"])  # families0/modernbert, families0/bert, families0/roberta
    assert [n.split("/")[-1] for n in names] == list(FAMILIES) and names == list(res["average"])
    for name, (family, (max_len, code)) in zip(names, FAMILIES.items()):
        about = res["model_info"][name]
        assert (about["family"], about["max_len"]) == (family, max_len) and about["code"].startswith(code)
        assert f"{name} = {models / family} ({family}, up to {max_len} tokens; {about['code']})" in md
    for task in ("gad", "multilabel", "ncbi"):  # each model at its own maximum length; the deltas paired over seeds
        row = res["tasks"][task]["models"]
        assert [row[m]["ran_with"]["max_len"] for m in names] == [v[0] for v in FAMILIES.values()]
        for m in names[1:]:
            a, b = row[names[0]]["macro_f1"]["per_seed"], row[m]["macro_f1"]["per_seed"]
            assert len(a) == len(b) == 2
            assert row[m]["delta_macro_f1"]["mean"] == pytest.approx(np.mean(np.subtract(b, a)), abs=1e-12)
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| task")]
    assert [r.split("|")[1].split()[0] for r in rows] == ["gad", "multilabel", "ncbi", "**average**"]
    delta = r" [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]( \*)? \|"
    assert all(r.count("|") == 10 and re.search(f"\\|{delta}{delta}$", r) for r in rows)
    # task, three models x (macro F1, upstream), the two paired deltas and their intervals


# -----------------------------------------------------------------------------
# Parity: our ModernBERT path and transformers' ModernBERT classes on one checkpoint


class Stop(Exception):
    """Raised by the optimizer's step: the gradients it would apply stay on the parameters."""


@pytest.mark.parametrize("task", ["cls", "multilabel", "ner"])
def test_finetune_step_has_the_gradients_of_transformers_modernbert_loss(models, tmp_path, monkeypatch, task):
    """eval.finetune's first optimizer step (float32, dropout 0, one batch in micro batches) holds the loss and
    gradients of transformers' ModernBertFor*Classification on the same checkpoint, as does eval.py's transformers
    path (Padded): a ModernBERT row and a baseline row differ by their models, not by the code that ran them.
    Gradients, not weights: AdamW's first update, about lr x sign(g), hides a loss scaled by a constant."""
    tok, _ = eval.check_model(str(models / "modernbert"), None, CPU, FLOAT32)
    examples, labels = task_examples(task)
    splits = eval.encode_splits({"train": examples, "validation": examples, "test": examples}, tok, task, labels, 64)
    items = splits["train"]["items"]
    assert len({len(x) for x, _ in items}) > 3
    if task == "multilabel":
        assert max(sum(y) for _, y in items) >= 2
    if task == "ner":  # -100 on more than [CLS] and [SEP]
        assert sum(y.count(-100) - 2 for _, y in items) > len(items)
    torch.manual_seed(0)
    args = eval.argparse.Namespace(model=str(models / "modernbert"), task=task, pooling="mean", batch_size=len(items),
                                   epochs=1, lr=1e-3, weight_decay=0.01, warmup_ratio=0.0, max_tokens=80,
                                   select="macro_f1")
    ours = eval.classifier(args, labels)
    assert not any(v for k, v in vars(ours.config).items() if k.endswith("dropout"))  # train mode is deterministic
    with torch.no_grad():  # away from the init, head included: finetune loads this head rather than drawing one
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours.save_pretrained(tmp_path / "ckpt")
    args.model = str(tmp_path / "ckpt")

    seen, accumulate = {}, eval.accumulate

    def keep(model, mine, *a, **k):
        seen["model"], seen["mine"], seen["loss"] = model, mine, accumulate(model, mine, *a, **k)
        return seen["loss"]

    def stop(self, *a, **k):
        raise Stop

    monkeypatch.setattr(eval, "accumulate", keep)
    monkeypatch.setattr(torch.optim.AdamW, "step", stop)
    with pytest.raises(Stop):
        eval.finetune(args, 0, splits, labels, CPU, 0, 1, torch.autocast("cpu", enabled=False), torch.float32)
    parts = eval.micro_batches(seen["mine"], 80)  # in finetune's order: several, of different sizes, in budget
    assert len(seen["mine"]) == len(items) and len(parts) > 3 and len({len(p) for p in parts}) > 1
    assert all(sum(len(x) for x, _ in p) <= 80 or len(p) == 1 for p in parts)

    auto = transformers.AutoModelForTokenClassification if task == "ner" else \
        transformers.AutoModelForSequenceClassification
    hf = auto.from_pretrained(tmp_path / "ckpt")
    assert hf.__class__.__name__ == seen["model"].__class__.__name__  # transformers' class of the same name
    ids, mask, targets = reference_batch(items, task, hf.config.pad_token_id)
    ref = hf(input_ids=ids, attention_mask=mask, labels=targets)
    ref.loss.backward()
    padded = baselines.classifier(args.model, task, ours.config.id2label, ours.config.problem_type).eval()
    with torch.no_grad():
        logits = flat_logits(seen["model"], items, task)
        padded_loss = eval.task_loss_sum(padded, items, task, CPU) / eval.count_targets(items, task, len(labels))
    torch.testing.assert_close(logits, (ref.logits[mask.bool()] if task == "ner" else ref.logits).detach(),
                               rtol=0, atol=1e-5)
    assert padded_loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    hf_grads = dict(hf.named_parameters())
    gaps = {k: ((p.grad - hf_grads[k].grad).abs().max() / hf_grads[k].grad.abs().max()).item()
            for k, p in seen["model"].named_parameters()}
    assert len(gaps) == len(hf_grads) and max(gaps.values()) < 1e-4, max(gaps.items(), key=lambda kv: kv[1])
    assert seen["loss"] == pytest.approx(ref.loss.item(), rel=1e-5)
