"""eval.py: metrics against seqeval and scikit-learn, heads against transformers, learning, the selected epoch's
weights, Trainer's optimizer. (eval.py under torchrun: test_suite.py.)"""

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import eval as eval_py
from eval import classification_metrics, encode_examples, multilabel_metrics, ner_metrics
from model import (ModernBertConfig, ModernBertForMaskedLM, ModernBertForSequenceClassification,
                   ModernBertForTokenClassification)
from support.tokenizer import load_tokenizer, train_bpe


def test_metrics_hand_checked_and_equal_seqeval_and_sklearn():
    from eval import entities
    assert entities([["B-A", "I-A", "O", "I-A", "I-B", "B-B"]]) == [("A", 0, 1), ("A", 3, 3), ("B", 4, 4), ("B", 5, 5)]
    seqeval = pytest.importorskip("seqeval.metrics")
    tags = ["O", "B-DIS", "I-DIS", "B-CHEM", "I-CHEM", "B-GENE", "I-GENE"]
    for seed in range(5):
        rng = random.Random(seed)  # random tags: full of ill-formed BIO (I- without B-, type switches)
        gold = [[rng.choice(tags) for _ in range(rng.randint(1, 20))] for _ in range(60)]
        pred = [[t if rng.random() < 0.7 else rng.choice(["O", "B-DIS", "I-DIS", "I-CHEM", "B-GENE"]) for t in seq]
                for seq in gold]
        ours = ner_metrics(gold, pred)
        for avg in ("micro", "macro"):
            assert ours[f"{avg}_f1"] == pytest.approx(seqeval.f1_score(gold, pred, average=avg), abs=1e-12)
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    for _ in range(3):
        y_true, y_pred = rng.integers(0, 5, 200), rng.integers(0, 6, 200)
        ours = classification_metrics(y_true, y_pred)
        assert ours["accuracy"] == pytest.approx(sk.accuracy_score(y_true, y_pred))
        for avg in ("macro", "micro", "weighted"):
            assert ours[f"{avg}_f1"] == pytest.approx(sk.f1_score(y_true, y_pred, average=avg, zero_division=0))
        Y_true, Y_pred = rng.integers(0, 2, (100, 6)), rng.integers(0, 2, (100, 6))
        Y_true[:, 5] = 0  # a label never present
        ml = multilabel_metrics(Y_true, Y_pred)
        for avg in ("macro", "micro"):
            assert ml[f"{avg}_f1"] == pytest.approx(sk.f1_score(Y_true, Y_pred, average=avg, zero_division=0))


def test_ner_labels_the_first_sub_token_of_each_word_hand_checked(tmp_path):
    # a sentence longer than max_len is cut between words, each piece framed by [CLS] ... [SEP]
    train_bpe(iter(["the cell binds the gene"] * 50), 300, str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    words = ["the", " cells", " xqzv", " binds"]
    words = dict(zip(words, tok.encode_batch(words)))
    assert [len(x) for x in words.values()] == [1, 2, 5, 1]  # " cell" + "s"; xqzv: bytes never seen in training
    example = {"tokens": ["the", "cells", "xqzv", "binds"], "tags": ["O", "B-DIS", "I-DIS", "O"]}
    labels = ["O", "B-DIS", "I-DIS"]  # ids 0, 1, 2
    (ids, target), = encode_examples([example], tok, "ner", labels, 512)["items"]
    assert ids == [tok.cls_id, *(i for x in words.values() for i in x), tok.sep_id]
    assert target == [-100, 0, 1, -100, 2, -100, -100, -100, -100, 0, -100]
    split = encode_examples([example], tok, "ner", labels, 7)  # at most 5 sub-tokens between [CLS] and [SEP]
    assert [target for _, target in split["items"]] == [[-100, 0, 1, -100, -100],
                                                        [-100, 2, -100, -100, -100, -100, -100], [-100, 0, -100]]
    assert split["where"] == [[(0, 0), (0, 1)], [(0, 2)], [(0, 3)]]  # (example, word) of each first sub-token


TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            local_attention=8, pad_token_id=0, cls_token_id=2, sep_token_id=3)


@pytest.mark.parametrize("kind,pooling", [("sequence", "mean"), ("sequence", "cls"), ("token", "mean")])
def test_heads_start_from_an_mlm_checkpoint_and_interoperate_with_transformers(kind, pooling, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours_cls = ModernBertForSequenceClassification if kind == "sequence" else ModernBertForTokenClassification
    hf_cls = getattr(transformers, ours_cls.__name__)
    labels = {"0": "neg", "1": "neu", "2": "pos"}
    torch.manual_seed(0)
    mlm = ModernBertForMaskedLM(ModernBertConfig(**TINY))
    mlm.save_pretrained(tmp_path / "mlm")
    ours = ours_cls.from_pretrained(tmp_path / "mlm", id2label=labels, classifier_pooling=pooling).eval()
    assert torch.equal(ours.model.layers[1].mlp.Wi.weight, mlm.model.layers[1].mlp.Wi.weight)
    assert torch.equal(ours.head.dense.weight, mlm.head.dense.weight)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours.save_pretrained(tmp_path / "ours")
    hf, info = hf_cls.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf.config.num_labels == 3 and hf.config.classifier_pooling == pooling
    ids = torch.randint(4, 300, (3, 30))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    hf.save_pretrained(tmp_path / "hf")  # and back
    back = ours_cls.from_pretrained(tmp_path / "hf").eval()
    real = mask.bool() if kind == "token" else slice(None)
    with torch.no_grad():
        a, b = ours(ids, mask)[real], hf.eval()(input_ids=ids, attention_mask=mask).logits[real]
        c = back(ids, mask)[real]
    assert (a - b).abs().max() <= 1e-5 and (c - a).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("model")
    words = "red green blue cyan magenta yellow black white grey pink".split()
    train_bpe(iter([" ".join(words)] * 20 + ["alpha beta gamma"] * 20), 300, str(tmp / "tokenizer.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(**TINY)).save_pretrained(tmp)
    return str(tmp)


def write_task(path, sizes, row, seed):
    rng = random.Random(seed)
    os.makedirs(path, exist_ok=True)
    for split, n in zip(("train", "validation", "test"), sizes):
        (path / f"{split}.jsonl").write_text("".join(json.dumps(row(rng)) + "\n" for _ in range(n)))


def separable_task(path):
    def row(rng):  # label: which of two word families a text uses
        label = rng.choice(["warm", "cold"])
        words = ["red", "yellow", "pink", "magenta"] if label == "warm" else ["blue", "cyan", "grey", "black"]
        return {"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))), "label": label}
    write_task(path, (160, 40, 40), row, 0)


def fine_tune(tiny_model, tmp, task, seed, *options):
    """eval.py --save_model on tmp/task, one seed on CPU -> (its results.json, eval_in_process's optimizer steps)."""
    steps = eval_in_process(["--model", tiny_model, "--task", task, "--data", str(tmp / "task"), "--seeds", str(seed),
                             "--save_model", "--out", str(tmp / "out"), "--device", "cpu", *options])
    return json.loads((tmp / "out" / "results.json").read_text()), steps


def test_learns_selects_the_first_best_epoch_refuses_bad_inputs(tiny_model, tmp_path, capsys):
    separable_task(tmp_path / "task")
    results, _ = fine_tune(tiny_model, tmp_path, "cls", 7, "--epochs", "4", "--lr", "3e-3", "--select", "accuracy")
    assert results["summary"]["macro_f1"]["mean"] > 0.95
    run = results["runs"][0]
    accuracy = [e["validation"]["accuracy"] for e in run["epochs"]]
    assert len(accuracy) == 4 and run["selected_by"] == "accuracy"
    assert run["best_epoch"] == 1 + accuracy.index(max(accuracy))
    settings = results["settings"]  # resolved: the model's full context, the CPU budget, no warmup
    assert (settings["max_len"], settings["max_tokens"], settings["warmup_ratio"]) == (8192, 4096, 0.0)
    with pytest.raises(SystemExit):
        eval_py.main(["--model", tiny_model, "--task", "ner", "--data", str(tmp_path / "task"), "--select", "accuracy"])
    assert "--select=accuracy: for --task ner it is one of macro_f1, micro_f1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_py.main(["--model", tiny_model, "--task", "cls", "--data", str(tmp_path / "task"), "--compile", "inductr"])
    assert "--compile='inductr': choose auto, True, False or a torch.compile backend, e.g. inductor or aot_eager" in capsys.readouterr().err

    (tmp_path / "task" / "validation.jsonl").write_text("")  # (a split missing, a label unseen: test_suite.py)
    with pytest.raises(SystemExit, match="validation.jsonl: the split is empty"):
        eval_py.main(["--model", tiny_model, "--task", "cls", "--data", str(tmp_path / "task"), "--device", "cpu"])


# -----------------------------------------------------------------------------
# The saved model re-scored by hand (HF tokenizers, a plain forward, scikit-learn); the optimizer as Trainer's


def eval_in_process(argv):
    """eval.main(argv) -> per optimizer step, per param group: (lr, weight_decay, betas, eps, the params' ndim)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    steps = []
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: steps.append(
        [(g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"], [p.ndim for p in g["params"]])
         for g in opt.param_groups]))
    try:
        eval_py.main(argv)
    finally:
        hook.remove()
    return steps


@pytest.fixture(scope="module")
def flipped_run(tiny_model, tmp_path_factory):
    """Validation labels flipped: the best epoch is an early one, not the last. 3 epochs of 10 steps, warmup 0.25."""
    tmp = tmp_path_factory.mktemp("flipped")
    separable_task(tmp / "task")
    path = tmp / "task" / "validation.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "label": {"warm": "cold", "cold": "warm"}[r["label"]]}) + "\n"
                            for r in rows))
    results, steps = fine_tune(tiny_model, tmp, "cls", 7, "--epochs", "3", "--lr", "2e-5", "--warmup_ratio", "0.25")
    return dict(steps=steps, task=tmp / "task", model=tmp / "out" / "model-seed7", results=results)


def rescore(model_dir, tokenizer_dir, path, labels, task="cls"):
    """A saved model re-run on the examples of `path`, one [CLS] ... [SEP] at a time, by HF tokenizers (a word after
    the first with its space) -> (the examples, their predictions, the logits): label ids (cls), 0/1 rows
    (multilabel), the tag of each word's first sub-token (ner)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    model = (ModernBertForTokenClassification if task == "ner" else ModernBertForSequenceClassification
             ).from_pretrained(model_dir).eval()
    assert [model.config.id2label[str(i)] for i in range(len(labels))] == labels
    examples, outputs = [json.loads(line) for line in path.read_text().splitlines()], []
    with torch.no_grad():
        for ex in examples:
            ids, firsts = [tok.token_to_id("[CLS]")], []
            for i, word in enumerate(ex["tokens"] if task == "ner" else [ex["text"]]):
                firsts.append(len(ids))
                ids += tok.encode(word if i == 0 else " " + word, add_special_tokens=False).ids
            outputs.append((model(torch.tensor([ids + [tok.token_to_id("[SEP]")]]))[0], firsts))
    if task == "ner":
        return examples, [[labels[int(out[k].argmax())] for k in firsts] for out, firsts in outputs], None
    logits = torch.stack([out for out, _ in outputs])
    predicted = (logits.sigmoid() >= 0.5).int().numpy() if task == "multilabel" else logits.argmax(-1).numpy()
    return examples, predicted, logits


def test_test_split_is_scored_with_the_selected_epochs_weights(flipped_run, tiny_model):
    sk = pytest.importorskip("sklearn.metrics")
    run, labels = flipped_run["results"]["runs"][0], flipped_run["results"]["settings"]["labels"]
    best, last = run["epochs"][run["best_epoch"] - 1]["validation"], run["epochs"][-1]["validation"]
    assert run["best_epoch"] < len(run["epochs"]) and best["macro_f1"] != last["macro_f1"]  # the case under test
    for split, reported in (("validation", best), ("test", run["test"])):
        examples, y_pred, _ = rescore(flipped_run["model"], tiny_model, flipped_run["task"] / f"{split}.jsonl", labels)
        y_true = [labels.index(ex["label"]) for ex in examples]
        assert sk.f1_score(y_true, y_pred, average="macro") == pytest.approx(reported["macro_f1"], abs=1e-12), split
        assert sk.accuracy_score(y_true, y_pred) == pytest.approx(reported["accuracy"], abs=1e-12), split


def test_fine_tuning_optimizer_is_the_trainers(flipped_run):
    """Trainer's AdamW: decay 0.01 on matrices only; get_linear_schedule_with_warmup, ceil(0.25 x 30) warmup steps."""
    from transformers import get_linear_schedule_with_warmup

    steps = flipped_run["steps"]
    schedule = get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=2e-5),
                                               num_warmup_steps=math.ceil(30 * 0.25), num_training_steps=30)
    expected = [2e-5 * schedule.lr_lambdas[0](k) for k in range(30)]
    assert len(steps) == 30
    for k, (groups, lr) in enumerate(zip(steps, expected)):
        assert all(g[0] == pytest.approx(lr, rel=1e-12, abs=1e-15) for g in groups), f"step {k}: {groups}, not {lr}"
    for lr, weight_decay, betas, eps, ndims in steps[0]:
        assert betas == (0.9, 0.999) and eps == 1e-8
        assert weight_decay == (0.01 if min(ndims) >= 2 else 0.0) and (max(ndims) < 2 or min(ndims) >= 2)
    assert sum(len(g[4]) for g in steps[0]) == len(list(ModernBertForSequenceClassification.from_pretrained(
        flipped_run["model"]).parameters()))  # every parameter is trained


def test_multilabel_predicts_at_probability_one_half(tiny_model, tmp_path):
    sk = pytest.importorskip("sklearn.metrics")
    families = {"warm": ["red", "yellow", "pink"], "cold": ["blue", "cyan", "grey"], "dark": ["black", "magenta"]}

    def row(rng):  # which of three word families a text uses
        present = [name for name in families if rng.random() < 0.5]
        words = [rng.choice(families[name]) for name in present for _ in range(rng.randint(1, 4))]
        return {"text": " ".join(rng.sample(words, len(words))) or "white", "labels": present}
    write_task(tmp_path / "task", (160, 32, 48), row, 1)
    results, _ = fine_tune(tiny_model, tmp_path, "multilabel", 3, "--epochs", "1", "--lr", "3e-3")
    labels, reported = results["settings"]["labels"], results["runs"][0]["test"]
    examples, y_pred, logits = rescore(tmp_path / "out" / "model-seed3", tiny_model, tmp_path / "task" / "test.jsonl",
                                       labels, "multilabel")
    assert (logits < 0).any() and ((logits > 0) & (logits < 0.5)).any()
    y_true = np.array([[int(label in ex["labels"]) for label in labels] for ex in examples])
    for avg in ("macro", "micro"):
        assert sk.f1_score(y_true, y_pred, average=avg, zero_division=0) == pytest.approx(reported[f"{avg}_f1"],
                                                                                          abs=1e-12), avg


def test_ner_scores_are_seqeval_on_the_saved_models_first_sub_tokens(tiny_model, tmp_path):
    seqeval = pytest.importorskip("seqeval.metrics")
    entities = {"COL": [["red"], ["dark", "red"], ["blue"], ["light", "cyan", "blue"]], "GRK": [["alpha"], ["beta"]]}
    filler = ["the", "a", "grey", "pinkish", "was", "seen", "near", "xqz"]  # "pinkish", "xqz": several sub-tokens

    def row(rng):  # many O words
        tokens, tags = [], []
        for _ in range(rng.randint(2, 5)):
            tokens += rng.sample(filler, rng.randint(1, 3))
            tags += ["O"] * (len(tokens) - len(tags))
            if rng.random() < 0.6:
                kind = rng.choice(sorted(entities))
                words = rng.choice(entities[kind])
                tokens += words
                tags += [f"B-{kind}"] + [f"I-{kind}"] * (len(words) - 1)
        return {"tokens": tokens, "tags": tags}
    write_task(tmp_path / "task", (160, 24, 40), row, 2)
    results, _ = fine_tune(tiny_model, tmp_path, "ner", 5, "--epochs", "2", "--lr", "3e-3")
    reported = results["runs"][0]["test"]
    examples, predicted, _ = rescore(tmp_path / "out" / "model-seed5", tiny_model, tmp_path / "task" / "test.jsonl",
                                     results["settings"]["labels"], "ner")
    gold = [ex["tags"] for ex in examples]
    assert any(len(ids) > 1 for ids in load_tokenizer(tiny_model).encode_batch([" " + w for w in filler]))
    assert reported["micro_f1"] > 0.3  # all-O scores 0: entities were learned
    assert seqeval.f1_score(gold, predicted, average="micro") == pytest.approx(reported["micro_f1"], abs=1e-12)
    assert seqeval.f1_score(gold, predicted, average="macro") == pytest.approx(reported["macro_f1"], abs=1e-12)


# -----------------------------------------------------------------------------
# Compiled (--compile): a few graphs for micro batches of any size and tasks of any label count; eager's scores


def noisy_task(path, task, n_train, labels=("warm", "cold")):
    """Texts of 1 to 30 words, each word of the label's family 60% of the time: scores short of 1, lengths varied."""
    families = [["red", "yellow", "pink"], ["blue", "cyan", "grey"], ["black", "magenta", "white"]]

    def row(rng):
        label = rng.randrange(len(labels))
        words = [rng.choice(families[label if rng.random() < 0.6 else rng.randrange(3)]) for _ in
                 range(rng.randint(1, 30))]
        if task == "ner":  # the label's family words are entities
            return {"tokens": words, "tags": ["B-X" if w in families[label] else "O" for w in words]}
        return {"text": " ".join(words), "label": labels[label]}
    write_task(path, (n_train, 40, 40), row, len(labels))


@pytest.mark.parametrize("task,kernel", [("cls", "sdpa"), ("ner", "varlen"), ("cls", "flash")])
def test_compiled_fine_tuning_runs_three_graphs_for_any_lengths_and_scores_as_eager(tiny_model, tmp_path, monkeypatch,
                                                                                   task, kernel):
    """--compile aot_eager (inductor's tracing, guards and autograd, without its code) on micro batches of dozens of
    sizes: a graph for training, one for evaluation, one for the epoch's last batch, of one example (packed); no graph
    break; the first losses and every score of the eager run. SDPA in float32 (the CPU path: equal to float noise),
    and under bf16 autocast the real wrappers of varlen_attn and flash-attn (the GPU path, tests/cpu_kernels.py: to
    bf16 noise), each taking the longest sequence as a symbol."""
    noisy_task(tmp_path / "task", task, 161)  # 161 = 10 x 16 + 1
    if kernel != "sdpa":
        import cpu_kernels
        if kernel == "flash" and cpu_kernels.flash_attn_varlen_func is None:
            pytest.skip(cpu_kernels.NO_FLASH)
        cpu_kernels.install(monkeypatch, backends=(kernel,))
    shapes, flat_batch = set(), eval_py.flat_batch

    def seen(items, *args):  # the sizes the model is called with: (tokens, sequences + 1, longest)
        flat, targets = flat_batch(items, *args)
        shapes.add((flat.tokens.numel(), flat.cu_seqlens.numel(), flat.max_seqlen))
        return flat, targets
    monkeypatch.setattr(eval_py, "flat_batch", seen)
    run = ["--model", tiny_model, "--task", task, "--data", str(tmp_path / "task"), "--seeds", "1", "--epochs", "2",
           "--lr", "1e-3", "--device", "cpu", *(["--dtype", "bfloat16"] if kernel != "sdpa" else [])]
    eval_py.main([*run, "--out", str(tmp_path / "eager"), "--compile", "false"])
    torch._dynamo.reset()
    counters.clear()
    eval_py.main([*run, "--out", str(tmp_path / "compiled"), "--compile", "aot_eager"])
    assert len(shapes) > 20 and (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (3, 0)
    if kernel != "sdpa":
        assert {c["dtype"] for c in cpu_kernels.calls[kernel]} == {torch.bfloat16}
    (eager,), (compiled,) = (json.loads((tmp_path / k / "results.json").read_text())["runs"] for k in ("eager",
                                                                                                       "compiled"))
    assert compiled["first_losses"] == pytest.approx(eager["first_losses"], rel=1e-5 if kernel == "sdpa" else 1e-2)
    assert 0.3 < eager["test"]["macro_f1"] < 0.99  # learned, not perfect: the scores depend on the numerics
    assert [e["validation"] for e in compiled["epochs"]] == [e["validation"] for e in eager["epochs"]]
    assert compiled["test"] == eager["test"]


def test_a_compiled_suite_shares_its_graphs_across_label_counts_and_stores_its_backend(tiny_model, tmp_path):
    """A suite of two tasks, of 2 and 3 labels, two seeds each, compiled: two graphs (training, evaluation) serve all
    four runs, the label count dynamic (per new count dynamo would compile both again: past 8 graphs, eager). Each run
    is stored with its backend, and the suite rerun eager refuses to mix those runs with its own."""
    noisy_task(tmp_path / "two", "cls", 48)
    noisy_task(tmp_path / "three", "cls", 48, labels=("warm", "cold", "dark"))
    (tmp_path / "suite.py").write_text("seeds = [1, 2]\ntasks = [" + ", ".join(
        f"dict(name={name!r}, task='cls', data={str(tmp_path / name)!r}, epochs=1, lr=1e-3)"
        for name in ("two", "three")) + "]\n")
    suite = ["--suite", str(tmp_path / "suite.py"), "--models", tiny_model, "--out", str(tmp_path / "out"),
             "--device", "cpu"]
    torch._dynamo.reset()
    counters.clear()
    eval_py.main([*suite, "--compile", "eager"])  # dynamo's tracing and guards, no autograd graph: the count is its
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (2, 0)
    stored = [json.loads(p.read_text()) for p in sorted((tmp_path / "out" / "runs").rglob("seed*.json"))]
    assert len(stored) == 4 and {s["options"]["compile"] for s in stored} == {"eager"}
    assert sorted(len(s["result"]["epochs"]) for s in stored) == [1] * 4
    with pytest.raises(SystemExit, match=r"4 stored run\(s\) cannot be reused(.|\n)*run with compile='eager'; now "
                                         r"compile=None"):
        eval_py.main([*suite, "--compile", "false"])
