"""
Fine-tuning evaluation over seeds, with the paper's protocol: AdamW (lr 5e-5, weight decay 0.01, batch 16), 10
epochs (20 for NER), test scored at the epoch of best validation macro F1 (--select). Where the paper says nothing,
the protocol it follows (BioClinical-ModernBERT, Hugging Face Trainer defaults): no warmup, linear decay to 0,
examples cut only at the model's maximum length. Each is an option here; support/suite.py's PROTOCOL cites them.

The model is a ModernBERT checkpoint, run by model.py (unpadded, our attention kernels), or any other Hugging Face
encoder with a fast tokenizer (BERT, RoBERTa, ...: the paper's baseline rows), run by transformers with its own
maximum length, special tokens and head (support/baselines.py; pip install transformers). A batch is cut into micro
batches of at most --max_tokens tokens, whose summed gradients make exactly the update of the whole batch. ModernBERT
runs compiled where train.py does (--compile; inductor on GPU), a few graphs for micro batches of any size (DYNAMIC).

    python eval.py --model out/clm/final --task ner --data ../shared/data/ncbi_disease
    python eval.py --model DIR --task cls --data DIR --seeds 42,43,44,45,46 --epochs 10
    torchrun --nproc_per_node=4 eval.py ...     # each batch sharded over GPUs; same numbers
    python eval.py --suite suites/en_bio.py --models out/en_base/final out/en_base_mlm/final --out out/eval_en
                                                # the paper's table: tasks x models x seeds (support/suite.py)

Data: a directory with train / validation (or dev, devel, valid) / test splits.
  cls:        JSONL {"text": ..., "label": ...}
  multilabel: JSONL {"text": ..., "labels": [...]}
  ner:        JSONL {"tokens": [...], "tags": [...]} or CoNLL/TSV (token TAB tag, blank line between sentences)
"""

import argparse
import contextlib
import copy
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from model import Flat, ModernBertForSequenceClassification, ModernBertForTokenClassification, cu_seqlens_of
from support import baselines, processes, suite, threads
from support.checkpoint import checkpoint_config
from support.files import check_out_dir, fresh_dir, json_lines, replace_file, user_error
from support.kernels import choose, compile_model, compiler
from support.lock import hold
from support.metrics import compile_stats
from support.tokenizer import check_vocab, load_tokenizer

# -----------------------------------------------------------------------------
# Metrics (checked against scikit-learn and seqeval in the tests)


def f1_from_counts(tp, fp, fn):
    """2 tp / (2 tp + fp + fn), elementwise on arrays; 0 where there was nothing to find and nothing was found."""
    return 2 * tp / np.maximum(2 * tp + fp + fn, 1)


def classification_metrics(y_true, y_pred):
    """Accuracy and macro / micro / weighted F1 over the labels seen in y_true or y_pred."""
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    labels = np.union1d(y_true, y_pred)
    t, p = y_true[:, None] == labels, y_pred[:, None] == labels  # one-hot (n, labels)
    f1s, support = f1_from_counts((t & p).sum(0), (~t & p).sum(0), (t & ~p).sum(0)), t.sum(0)
    accuracy = float((y_true == y_pred).mean())
    return {"macro_f1": float(f1s.mean()), "micro_f1": accuracy,
            "weighted_f1": float((f1s * support).sum() / support.sum()), "accuracy": accuracy}


def multilabel_metrics(y_true, y_pred):
    """y: (n, L) 0/1. Macro F1 over the L labels, micro F1 over all cells."""
    y_true, y_pred = np.asarray(y_true, bool), np.asarray(y_pred, bool)
    tp, fp, fn = (y_true & y_pred).sum(0), (~y_true & y_pred).sum(0), (y_true & ~y_pred).sum(0)
    return {"macro_f1": float(f1_from_counts(tp, fp, fn).mean()),
            "micro_f1": float(f1_from_counts(tp.sum(), fp.sum(), fn.sum())),
            "subset_accuracy": float((y_true == y_pred).all(1).mean())}


def entities(sequences):
    """(type, start, end) spans of BIO / IOB2 tag sequences, repaired as seqeval does: an I- that does
    not continue an entity of its type starts a new one. Sequences are joined with an O between them."""
    tags = [t for seq in sequences for t in [*seq, "O"]]
    spans, start, prev_tag, prev_type = [], None, "O", ""
    for i, tag in enumerate([*tags, "O"]):
        t, typ = (tag[0], tag[2:]) if tag != "O" else ("O", "")
        if prev_tag != "O" and (t in ("B", "O") or typ != prev_type):  # an entity ends
            spans.append((prev_type, start, i - 1))
        if t == "B" or (t == "I" and (prev_tag == "O" or typ != prev_type)):
            start = i
        prev_tag, prev_type = t, typ
    return spans


def ner_metrics(gold, pred):
    """Entity-level F1 (exact span and type): micro over entities, macro over entity types."""
    g, p = set(entities(gold)), set(entities(pred))
    types = sorted({e[0] for e in g | p})
    per_type = {t: float(f1_from_counts(*(sum(e[0] == t for e in s) for s in (g & p, p - g, g - p)))) for t in types}
    return {"macro_f1": float(np.mean(list(per_type.values()))) if types else 0.0,
            "micro_f1": float(f1_from_counts(len(g & p), len(p - g), len(g - p))), "per_type_f1": per_type}


# -----------------------------------------------------------------------------
# Data

SPLITS = {"train": ("train",), "validation": ("validation", "dev", "devel", "valid"), "test": ("test",)}
FIELDS = {"cls": ("text", "label"), "multilabel": ("text", "labels"), "ner": ("tokens", "tags")}


def read_split(path, task):
    examples = []
    if task == "ner" and not path.endswith(".jsonl"):
        tokens, tags = [], []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate([*f, "\n"], 1):
                if line.strip():
                    parts = line.rstrip("\n").split("\t") if "\t" in line else line.split()
                    if len(parts) < 2:
                        raise SystemExit(f"{path}:{n}: expected 'token<TAB>tag', got {line.strip()!r}")
                    tokens.append(parts[0])
                    tags.append(parts[-1])
                elif tokens:  # a blank line ends a sentence
                    examples.append({"tokens": tokens, "tags": tags})
                    tokens, tags = [], []
    else:
        forms = {}  # a label value -> how it was first written, and where
        with open(path, encoding="utf-8") as f:
            for n, ex in json_lines(f, path):
                if problem := example_problem(ex, task):
                    raise SystemExit(f"{path}:{n}: {problem}")
                examples.append({k: ex[k] for k in FIELDS[task]})
                for label in labels_of(ex, task):  # 1, 1.0 and True are one value but three class names
                    first, where = forms.setdefault(label, (str(label), n))
                    if first != str(label):
                        raise SystemExit(f"{path}:{n}: label {label!r} is label {first} (line {where}) written "
                                         "another way, which would make two classes of one; write labels alike")
    if not examples:
        raise SystemExit(f"{path}: the split is empty")
    return examples


def example_problem(ex, task):
    """What makes a JSON example unusable for `task` (numbers would be wrong, not just odd), or None."""
    if missing := [k for k in FIELDS[task] if not isinstance(ex, dict) or k not in ex]:
        return f"no {missing[0]!r} field; --task {task} needs {' and '.join(FIELDS[task])}"
    scalar = (str, int, float)  # a class label; bool is an int
    if task == "ner":
        tokens, tags = ex["tokens"], ex["tags"]
        if not (isinstance(tokens, list) and isinstance(tags, list) and all(isinstance(x, str) for x in tokens + tags)):
            return "tokens and tags must be lists of strings"
        if len(tokens) != len(tags):
            return f"{len(tokens)} tokens but {len(tags)} tags; every token needs its tag (later sentences would shift)"
        return None if tokens else "an empty sentence (no tokens); remove the line"
    if not isinstance(ex["text"], str) or not ex["text"].strip():
        return f"the text is {ex['text']!r}, not a text; remove the line or give it its text"
    if task == "cls" and not isinstance(ex["label"], scalar):
        return f"label {ex['label']!r} must be one class name or number (for several, use --task multilabel)"
    if task == "multilabel" and not (isinstance(ex["labels"], list)
                                     and all(isinstance(x, scalar) for x in ex["labels"])):
        return f"labels {ex['labels']!r} must be a list of class names or numbers, e.g. [\"a\", \"b\"] or []"
    return None


def labels_of(ex, task):
    return [ex["label"]] if task == "cls" else ex["labels" if task == "multilabel" else "tags"]


def read_task(data_dir, task):
    """-> ({split: examples}, labels), every file readable and every label of validation and test seen in train."""
    if not os.path.isdir(data_dir):
        raise SystemExit(f"{data_dir}: no such directory")
    raw, paths = {}, {}
    exts = (".jsonl", ".tsv", ".conll", ".txt") if task == "ner" else (".jsonl",)
    for split in SPLITS:
        names = [name + ext for name in SPLITS[split] for ext in exts]
        paths[split] = path = next(filter(os.path.isfile, (os.path.join(data_dir, x) for x in names)), None)
        if path is None:
            raise SystemExit(f"{data_dir}: no {split} split; expected one of " + ", ".join(names))
        try:
            raw[split] = read_split(path, task)
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"{path}: cannot read it ({e})") from None
    seen = {split: [set(map(str, labels_of(ex, task))) for ex in raw[split]] for split in SPLITS}
    labels = sorted(set().union(*seen["train"]), key=(lambda t: (t != "O", t[2:], t)) if task == "ner" else None)
    for split in ("validation", "test"):
        for n, unknown in enumerate(s - set(labels) for s in seen[split]):
            if unknown:
                raise SystemExit(f"{paths[split]}: example {n + 1} has label(s) {sorted(unknown)} that the training "
                                 f"split never uses (labels: {labels})")
    return raw, labels


def encode_examples(examples, tok, task, labels, max_len):
    """-> {"items": [(token ids, target), ...], "where", "examples"}: a target is a label id (cls), a 0/1 vector
    (multilabel) or the tag id on each word's first sub-token and -100 elsewhere (ner). NER sentences longer than
    max_len are split at word boundaries, never truncated; "where" holds each sequence's (example, word) pairs so
    that scoring can put them back together. `tok` is ours or another family's (support/baselines.py)."""
    index = {label: i for i, label in enumerate(labels)}
    ours = not isinstance(tok, baselines.Tokenizers)
    if task != "ner":
        texts = [ex["text"] for ex in examples]
        ids = [[tok.cls_id, *x[:max_len - 2], tok.sep_id] for x in tok.encode_batch(texts)] if ours else \
            tok.texts(texts, max_len)
        targets = [index[str(ex["label"])] for ex in examples] if task == "cls" else \
            [[float(label in owned) for label in labels] for owned in (set(map(str, ex["labels"])) for ex in examples)]
        return {"items": list(zip(ids, targets)), "where": None, "examples": examples}
    if ours:  # each word as it reads in running text (a space before all but the first)
        pieces = iter(tok.encode_batch([w if i == 0 else " " + w for ex in examples
                                        for i, w in enumerate(ex["tokens"])]))
        # a word with no sub-token (e.g. a lone control char) stands as [MASK]
        sentences = [([tok.cls_id], [next(pieces) or [tok.mask_id] for _ in ex["tokens"]], [tok.sep_id])
                     for ex in examples]
    else:
        sentences = tok.sentences([ex["tokens"] for ex in examples])
    out, where = [], []
    for e, (ex, (before, words, after)) in enumerate(zip(examples, sentences)):
        room = max_len - len(before) - len(after)  # sub-tokens a sequence holds between its special tokens
        # consecutive words (each cut to `room` sub-tokens) that fill at most `room`: micro_batches' grouping
        cut = [(sub[:room], w, index[tag]) for w, (sub, tag) in enumerate(zip(words, ex["tags"]))]
        for chunk in micro_batches(cut, room):
            tags = [t for sub, _, tag in chunk for t in [tag] + [-100] * (len(sub) - 1)]
            out.append(([*before, *(t for sub, _, _ in chunk for t in sub), *after],
                        [-100] * len(before) + tags + [-100] * len(after)))
            where.append([(e, w) for _, w, _ in chunk])
    return {"items": out, "where": where, "examples": examples}


def encode_splits(raw, tok, task, labels, max_len):
    return {split: encode_examples(examples, tok, task, labels, max_len) for split, examples in raw.items()}


def micro_batches(items, max_tokens, max_items=None, padded=False):
    """Consecutive groups of at most max_tokens tokens (and max_items items); a longer item is a group of its own.
    padded (a transformers model): a group counts its padded batch, its size x its longest item."""
    groups, size, longest = [[]], 0, 0
    for item in items:
        n = len(item[0])
        tokens = (len(groups[-1]) + 1) * max(longest, n) if padded else size + n  # with this item in the group
        if groups[-1] and (tokens > max_tokens or len(groups[-1]) == max_items):
            groups.append([])
            size, longest = 0, 0
        groups[-1].append(item)
        size, longest = size + n, max(longest, n)
    return groups


def flat_batch(items, task, device):
    """A list of (ids, target) -> (the model's Flat batch, the targets: one per token for ner, else per item)."""
    lengths = [len(x) for x, _ in items]
    tokens = torch.tensor([t for x, _ in items for t in x], device=device)
    targets = [t for _, y in items for t in y] if task == "ner" else [y for _, y in items]
    return Flat(tokens, cu_seqlens_of(lengths).to(device), max(lengths)), torch.tensor(targets, device=device)


# -----------------------------------------------------------------------------
# Fine-tuning one seed

# Compiled (--compile), what changes from one micro batch or task to the next is dynamic from the first graph on,
# named as dynamo sees the classifiers' forward: a micro batch's tokens, sequences and longest sequence, a task's
# labels (the classifier's rows). Whatever the lengths and tasks: a graph for training, one for evaluation, one for a
# micro batch of sequences of one length (packed: other kernels). Left to dynamo, each size recompiles once it changes
# and each label count twice, eager past recompile_limit (8). Padding micro batches to a few token counts instead
# would leave their sequences and longest varying, and compute the pad.
DYNAMIC = ",".join(["L['input_ids']", "L['cu_seqlens']", "L['max_seqlen']",
                    *(f"L['self']._modules['classifier']._parameters['{p}']" for p in ("weight", "bias"))])


def task_loss_sum(model, items, task, device):
    flat, targets = flat_batch(items, task, device)
    logits = model(flat.tokens, cu_seqlens=flat.cu_seqlens, max_seqlen=flat.max_seqlen)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bfloat16 up; float64 (tests) kept
    if task == "multilabel":
        return F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="sum")
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def count_targets(items, task, n_labels):
    if task == "ner":
        return sum(sum(t != -100 for t in y) for _, y in items)
    return len(items) * (n_labels if task == "multilabel" else 1)


def accumulate(model, items, task, device, weight, max_tokens, autocast, padded=False):
    """Backward of weight x the summed loss, one micro batch at a time: the gradients add up to those of one
    forward. Under DDP only the last micro batch all-reduces (ranks may have different numbers). -> the loss."""
    parts, total = micro_batches(items, max_tokens, padded=padded), 0.0
    for k, part in enumerate(parts):
        with model.no_sync() if hasattr(model, "no_sync") and k < len(parts) - 1 else contextlib.nullcontext():
            with autocast:
                loss = task_loss_sum(model, part, task, device) * weight
            loss.backward()
        total += loss.item()
    return total


@torch.no_grad()
def evaluate(model, split, labels, args, device, rank, world, autocast, padded):
    """The metrics of the model's predictions on an encoded split: label ids (cls), 0/1 rows (multilabel), per-token
    tag ids (ner); each rank predicts every world-th item."""
    task, items = args.task, split["items"]
    model.eval()
    mine = [(items[i][0], i) for i in range(rank, len(items), world)]  # (ids, index): grouped like training items
    preds = {}
    for group in micro_batches(mine, args.max_tokens, args.batch_size, padded):
        idx = [i for _, i in group]
        flat, _ = flat_batch([items[i] for i in idx], task, device)
        with autocast:
            logits = model(flat.tokens, cu_seqlens=flat.cu_seqlens, max_seqlen=flat.max_seqlen).float()
        if task == "ner":
            tags, cu = logits.argmax(-1).tolist(), flat.cu_seqlens.tolist()  # one device-to-host copy each
            out = [tags[cu[j]:cu[j + 1]] for j in range(len(idx))]
        else:
            out = (logits > 0).int().tolist() if task == "multilabel" else logits.argmax(-1).tolist()
        preds.update(zip(idx, out))
    if dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, preds)
        preds = {k: v for p in parts for k, v in p.items()}
    model.train()
    preds = [preds[i] for i in range(len(items))]
    if task != "ner":
        return (classification_metrics if task == "cls" else multilabel_metrics)([y for _, y in items], preds)
    # NER: the prediction of each word is its first sub-token's; stitch split sentences back together
    pred_tags = [["O"] * len(ex["tokens"]) for ex in split["examples"]]
    for (_, y), p, owners in zip(items, preds, split["where"]):
        firsts = [k for k, t in enumerate(y) if t != -100]
        for (e, w), k in zip(owners, firsts):
            pred_tags[e][w] = labels[p[k]]
    return ner_metrics([ex["tags"] for ex in split["examples"]], pred_tags)


def classifier(args, labels):
    """The model with a new classifier over `labels` (its init from torch's RNG): ModernBERT by model.py, another
    family by transformers with that family's head (--pooling is ModernBERT's)."""
    id2label = {str(i): label for i, label in enumerate(labels)}
    problem = {"cls": "single_label_classification", "multilabel": "multi_label_classification"}.get(args.task)
    if not baselines.is_modernbert(args.model):
        return baselines.classifier(args.model, args.task, id2label, problem)
    model_cls = ModernBertForTokenClassification if args.task == "ner" else ModernBertForSequenceClassification
    return model_cls.from_pretrained(args.model, id2label=id2label, problem_type=problem,
                                     classifier_pooling=args.pooling, attn_out_dropout=None)


def finetune(args, seed, splits, labels, device, rank, world, autocast, dtype, compiled=None):
    """One seed: train, pick the best epoch by validation, score test. compiled: check_model's torch.compile backend
    (None: eager), whose graphs serve every seed and task (a new model passes their guards: DYNAMIC)."""
    torch.manual_seed(seed)  # the new classifier's init, then dropout and shuffling
    core = classifier(args, labels)
    padded = isinstance(core, baselines.Padded)  # its micro batches count padded tokens
    core = core.to(device) if padded else core.place(device, dtype)  # ours: its kernels chosen before any graph
    model = run = compile_model(core, compiled) if compiled else core  # training's forward, and evaluation's
    if dist.is_initialized():
        model = torch.nn.parallel.DistributedDataParallel(run, device_ids=[device.index] if device.type == "cuda"
                                                          else None)
    train = splits["train"]["items"]
    steps_per_epoch = math.ceil(len(train) / args.batch_size)
    total = steps_per_epoch * args.epochs
    warmup = math.ceil(total * args.warmup_ratio)  # the Trainer's count (TrainingArguments.get_warmup_steps)
    # AdamW with the Hugging Face Trainer's betas and eps, and its "linear" schedule: linear warmup, then decay to 0
    opt = torch.optim.AdamW(core.param_groups(args.weight_decay), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup)))
    g = torch.Generator().manual_seed(seed)
    history, best, best_state, first_losses = [], None, None, []
    for epoch in range(args.epochs):
        t0 = time.time()
        order = torch.randperm(len(train), generator=g).tolist()
        bar = tqdm(range(steps_per_epoch), desc=f"seed {seed} epoch {epoch + 1}/{args.epochs}",
                   disable=rank != 0 or None, leave=False)
        for s in bar:
            threads.follow()
            batch = [train[i] for i in order[s * args.batch_size:(s + 1) * args.batch_size]]
            n = count_targets(batch, args.task, len(labels))  # the loss is the mean over the global batch
            mine, weight = batch[rank::world], world / max(n, 1)  # DDP averages over ranks: x world
            if not mine:
                # A last batch with fewer examples than ranks: run one weighted 0, as DDP's all-reduce is armed by
                # the forward, and a rank that skips it leaves the others waiting forever.
                mine, weight = batch[:1], 0.0
            loss = accumulate(model, mine, args.task, device, weight, args.max_tokens, autocast, padded)
            if len(first_losses) < 10:  # the first steps' loss (the batch's mean, over every rank) is recorded:
                summed = torch.tensor(loss, dtype=torch.float64, device=device)  # runs compare across devices by it
                if dist.is_initialized():
                    dist.all_reduce(summed)
                first_losses.append(summed.item() / world)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss / world:.4f}")
        val = evaluate(run, splits["validation"], labels, args, device, rank, world, autocast, padded)
        history.append({"epoch": epoch + 1, "validation": val, "seconds": time.time() - t0})
        if best is None or val[args.select] > best["validation"][args.select]:
            best = history[-1]
            best_state = copy.deepcopy(core.state_dict())
        if rank == 0:
            tqdm.write(f"seed {seed} epoch {epoch + 1}: validation macro F1 {val['macro_f1']:.4f} "
                       f"micro F1 {val['micro_f1']:.4f} ({time.time() - t0:.1f}s)")
    core.load_state_dict(best_state)
    test = evaluate(run, splits["test"], labels, args, device, rank, world, autocast, padded)
    return core, {"seed": seed, "best_epoch": best["epoch"], "selected_by": args.select, "test": test,
                  "epochs": history, "first_losses": first_losses}


# -----------------------------------------------------------------------------
# A suite: every (task, model, seed) of a suite file, each stored as it finishes; the table (support/suite.py)


def check_model(path, tokenizer, device, dtype, compiled=None):
    """-> (its tokenizer, what the table records of it: family, max_len, the code that runs it and its torch.compile
    backend), once it loads and the tokenizer fits its embedding: ModernBERT on model.py, compiled where `compiled`
    (the process's backend) says; any other family on transformers (baselines.py), eager."""
    if not baselines.is_modernbert(path):
        tok, about = baselines.check_encoder(path, f"--model {path}")
        return tok, {**about, "compiled": None}  # padded batches, eager
    checkpoint_config(path, f"--model {path}")
    if not tokenizer and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise SystemExit(f"{path} has no tokenizer.json; pass --tokenizer")
    with user_error(f"--tokenizer {tokenizer or path}"):  # a missing or unreadable --tokenizer
        tok = load_tokenizer(tokenizer or path)
    with user_error(f"--model {path}"):  # not ModernBERT, no weights, weights of another shape
        config = ModernBertForSequenceClassification.from_pretrained(path, id2label={"0": "a", "1": "b"}).config
    check_vocab(tok.vocab_size, config, "the tokenizer", f"--model {path}",
                "pass the tokenizer the model was trained with (--tokenizer)")
    backend = choose(config.attn_backend, device, dtype, config.attention_dropout).of(packed=False)  # examples
    return tok, {"family": "modernbert", "max_len": config.max_position_embeddings, "compiled": compiled,
                 "code": f"model.py ModernBertForSequenceClassification / ModernBertForTokenClassification, unpadded, "
                         f"attention {backend}" + (f", torch.compile {compiled}" if compiled else "")}


def full_context(max_len, positions, where):
    if max_len is not None and max_len > positions:
        raise SystemExit(f"{where}: max_len={max_len} is beyond the model's {positions} positions; give at most "
                         f"{positions}, or leave it out for the model's full context")
    return max_len or positions


def suite_runs(args, seeds, tasks, names, device, dtype, compiled):
    """Every model and task checked before anything trains (not hours in), else one SystemExit listing every problem
    -> ({model: tokenizer}, {model: what the table records of it}, {task: (splits, labels)}, the runs in order).
    A run's options, what finetune() sees less where it runs and writes, identify its file (no stale run reused)."""
    problems, toks, about, data, runs = [], {}, {}, {}, []
    for path in args.models:
        try:
            toks[path], about[path] = check_model(path, args.tokenizer, device, dtype, compiled)
        except SystemExit as e:
            problems.append(f"model {path}: {e}")
    for t in tasks:
        try:
            data[t["name"]] = read_task(t["data"], t["task"])
            for path, name in zip(args.models, names):
                if path not in about:  # the model's problem is listed already
                    continue
                max_len = full_context(t["max_len"], about[path]["max_len"], f"model {path}")
                run_args = argparse.Namespace(**{**vars(args), **{k: t[k] for k in suite.TASK_KEYS if k != "name"},
                                                 "model": os.path.abspath(path), "max_len": max_len,
                                                 "max_tokens": t["max_tokens"] or suite.max_tokens(device)})
                # Compiled, a run differs from an eager one in the last bits (inductor fuses and reorders sums),
                # which epochs of training carry into the scores: its backend is part of what identifies it, so
                # a suite never silently mixes the two. Eager, nothing is added: runs stored before --compile resume.
                options = {k: v for k, v in {**vars(run_args), "dtype": str(dtype).removeprefix("torch.")}.items()
                           if k not in ("suite", "models", "out", "seeds", "device", "save_model", "compile")}
                options.update({"compile": about[path]["compiled"]} if about[path]["compiled"] else {})
                runs += [dict(task=t, model=path, name=name, seed=seed, args=run_args, file=suite.run_file(
                    args.out, t["name"], name, seed), options={**options, "seed": seed}) for seed in seeds]
        except SystemExit as e:
            problems.append(f"task {t['name']!r}: {e}")
    if problems:
        raise SystemExit(f"{args.suite}: nothing was trained; first fix:\n  " + "\n  ".join(problems))
    return toks, about, data, runs


def run_suite(args, process, autocast, dtype):
    """eval.py --suite FILE --models DIR ...: every task x model x seed, then results.md/.json."""
    rank, world, device = process.rank, process.world, process.device
    seeds, tasks = suite.load_suite(args.suite)
    names = suite.model_names(args.models)
    toks, about, data, runs = suite_runs(args, seeds, tasks, names, device, dtype, process.compiled)
    hold(args.out, process)  # one suite writes --out at a time; a killed one's successor goes on where it stopped
    # Rank 0's disk says which runs are finished and the other ranks take its word: every rank must skip
    # the same runs, or the ranks that train one wait forever for those that skipped it.
    done, stale = processes.on_rank0(lambda: suite.finished_runs([(r["file"], r["options"]) for r in runs]), process)
    if stale:
        raise SystemExit(f"{args.out}: {len(stale)} stored run(s) cannot be reused for this suite:\n  "
                         + "\n  ".join(stale) + "\nDelete them to run them again with the suite's settings, or "
                         "write to another --out.")

    if rank == 0:
        print(f"{args.suite}: {len(runs)} runs ({len(tasks)} tasks x {len(names)} models x {len(seeds)} seeds): "
              f"{len(done)} finished earlier, {len(runs) - len(done)} to run" + threads.describe("; "))
    encoded, splits = None, None  # the (task name, model path) whose splits, in that model's tokens, are at hand
    with tqdm(total=len(runs), initial=len(done), desc="suite", unit="run", disable=rank != 0 or None) as bar:
        for i, r in enumerate(runs):
            if i in done:
                continue
            t, t0 = r["task"], time.time()
            raw, labels = data[t["name"]]
            if encoded != (t["name"], r["model"]):
                encoded = (t["name"], r["model"])
                splits = encode_splits(raw, toks[r["model"]], t["task"], labels, r["args"].max_len)
            model, result = finetune(r["args"], r["seed"], splits, labels, device, rank, world, autocast, dtype,
                                     about[r["model"]]["compiled"])
            done[i] = result
            if rank == 0:
                suite.store_run(r["file"], r["options"], result, args.out)
                if args.save_model:
                    model.save_pretrained(fresh_dir(r["file"].removesuffix(".json")))
                tqdm.write(f"run {t['name']} / {r['name']} / seed {r['seed']}: test macro F1 "
                           f"{100 * result['test']['macro_f1']:.2f} ({time.time() - t0:.1f}s)")
            bar.update()

    if rank == 0:
        scores = {}  # (task, model name) -> the test metrics of each seed, in the order of seeds
        for i, r in enumerate(runs):
            scores.setdefault((r["task"]["name"], r["name"]), []).append(done[i]["test"])
        results = suite.summarize(args.suite, seeds, tasks, dict(zip(names, args.models)), scores)
        results["model_info"] = {name: about[path] for name, path in zip(names, args.models)}
        for r in runs:  # what each model ran with, where the task left it to the model and the device
            results["tasks"][r["task"]["name"]]["models"][r["name"]]["ran_with"] = {
                k: getattr(r["args"], k) for k in ("max_len", "max_tokens")}
        print(suite.write_results(args.out, results))


def parse_args(argv):
    """The command line, with the protocol's defaults filled in (suite.PROTOCOL) and every value checked."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face ModernBERT checkpoint directory, or any other Hugging Face encoder "
                                   "directory with a fast tokenizer (run through transformers: support/baselines.py)")
    p.add_argument("--task", choices=["cls", "multilabel", "ner"])
    p.add_argument("--data", help="a directory with train / validation / test splits")
    # The fine-tuning protocol; what is not given is the paper's (suite.PROTOCOL, suite.EPOCHS).
    p.add_argument("--seeds", help=f"comma-separated (default {','.join(map(str, suite.SEEDS))})")
    p.add_argument("--epochs", type=int, help=f"default {suite.EPOCHS}")
    for k, typ in (("lr", float), ("weight_decay", float), ("warmup_ratio", float), ("batch_size", int)):
        p.add_argument(f"--{k}", type=typ, help=f"default {suite.PROTOCOL[k]}")
    p.add_argument("--max_len", type=int, help="tokens an example keeps, [CLS] and [SEP] included (default: the "
                                               "model's max_position_embeddings)")
    p.add_argument("--max_tokens", type=int, help="tokens per micro batch; a batch is split into micro batches with "
                   f"the same update (default {suite.MAX_TOKENS['cuda']} on GPU, {suite.MAX_TOKENS['cpu']} on CPU)")
    per_task = "".join(f"; {task}: {', '.join(names)}" for task, names in suite.SELECT.items())
    p.add_argument("--select", help=f"the validation metric that picks the best epoch (default "
                                    f"{suite.PROTOCOL['select']}{per_task})")
    p.add_argument("--pooling", choices=["mean", "cls"], help="ModernBERT's sequence classification pooling "
                   "(default mean); another family has its own head's")
    p.add_argument("--tokenizer", help="for a ModernBERT checkpoint without tokenizer.json (another family: its own)")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", default="auto", help="torch.compile of ModernBERT's fine-tuning, as train.py's: auto "
                   "(inductor on GPU, eager on CPU), true, false, or a backend (aot_eager); other families run eager")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bfloat16 autocast "
                   "on GPU (what the flash / varlen attention kernels need), float32 on CPU")
    p.add_argument("--out", default="out/eval")
    p.add_argument("--save_model", action="store_true", help="save the best model of each seed under --out")
    p.add_argument("--suite", help="a suite file (suites/en_bio.py): its tasks, with their settings, x --models x its "
                                   "seeds, then one table (support/suite.py); instead of --model, --task and --data")
    p.add_argument("--models", nargs="+", help="with --suite: the checkpoints to compare, the reference first")
    args = p.parse_args(argv)
    protocol = ["seeds", "epochs", *suite.PROTOCOL]
    given = [f"--{k}" for k in protocol if getattr(args, k) is not None]
    if args.suite and given:
        p.error(f"--suite takes the seeds and each task's settings from {args.suite}, so {', '.join(given)} would be "
                "ignored: set them in the suite file (a task's keys, or seeds = [...])")
    if args.suite and (not args.models or args.model or args.task or args.data):
        p.error("--suite takes its tasks from the file and the checkpoints from --models, not --model/--task/--data")
    if not args.suite and not (args.model and args.task and args.data):
        p.error("the following arguments are required: --model, --task, --data (or --suite FILE --models DIR ...)")
    if not args.suite:
        defaults = {**suite.PROTOCOL, "epochs": suite.EPOCHS[args.task], "seeds": ",".join(map(str, suite.SEEDS))}
        vars(args).update({k: defaults[k] for k in protocol if getattr(args, k) is None})
        bad = [f"--{k}={getattr(args, k)}" for k in ("epochs", "batch_size", "max_tokens", "max_len", "lr")
               if getattr(args, k) is not None and not getattr(args, k) > (2 if k == "max_len" else 0)]
        if bad or suite.parse_seeds(args.seeds) is None:  # max_len holds [CLS] and [SEP]
            p.error(f"{', '.join(bad) or '--seeds=' + args.seeds}: epochs, batch_size, max_tokens and lr must be "
                    "positive, max_len above 2, and seeds integers like 42,43,44")
        if args.select not in suite.SELECT[args.task]:
            p.error(f"--select={args.select}: for --task {args.task} it is one of {', '.join(suite.SELECT[args.task])}")
    try:
        compiler(args.compile, torch.device("cpu"))
    except ValueError as e:
        p.error(f"--{e}")
    check_out_dir(args.out)  # before any training: results are written there at the end
    return args


def run_task(args, process, autocast, dtype):
    """eval.py --model --task --data: fine-tune over the seeds, then a mean ± std table of the test metrics."""
    rank, world, device = process.rank, process.world, process.device
    tok, about = check_model(args.model, args.tokenizer, device, dtype, process.compiled)
    if args.tokenizer and about["family"] != "modernbert":
        raise SystemExit(f"--tokenizer {args.tokenizer}: a {about['family']} model is fine-tuned with its own "
                         f"tokenizer, from {args.model}; --tokenizer is for ModernBERT checkpoints without one")
    args.max_len = full_context(args.max_len, about["max_len"], "--max_len")
    args.max_tokens = args.max_tokens or suite.max_tokens(device)
    raw, labels = read_task(args.data, args.task)
    hold(args.out, process)  # one run writes --out at a time
    splits = encode_splits(raw, tok, args.task, labels, args.max_len)
    if rank == 0:
        print(f"{args.task}: {len(labels)} labels; train {len(raw['train'])}, validation {len(raw['validation'])}, "
              f"test {len(raw['test'])} examples ({len(splits['train']['items'])} training sequences); "
              f"{device}, {str(dtype).removeprefix('torch.')}, {about['family']}: {about['code']}; max_len "
              f"{args.max_len}, {args.max_tokens} tokens per micro batch" + threads.describe("; "))
    runs = []
    for seed in suite.parse_seeds(args.seeds):
        model, result = finetune(args, seed, splits, labels, device, rank, world, autocast, dtype, about["compiled"])
        runs.append(result)
        if rank == 0 and args.save_model:
            model.save_pretrained(fresh_dir(os.path.join(args.out, f"model-seed{seed}")))
    if rank == 0:
        keys = [k for k, v in runs[0]["test"].items() if isinstance(v, float)]
        summary = {k: suite.mean_std([r["test"][k] for r in runs]) for k in keys}
        table = "\n".join([f"| metric (test, {len(runs)} seeds) | mean ± std |", "|---|---|"]
                          + [f"| {k} | {suite.pct(v)} |" for k, v in summary.items()]) + "\n"
        print(table)
        replace_file(os.path.join(args.out, "results.json"), json.dumps(
            {"settings": {**vars(args), "labels": labels, "world_size": world, "model_info": about},
             "summary": summary, "runs": runs}, indent=2))
        replace_file(os.path.join(args.out, "results.md"), table)


def main(argv=None):
    args = parse_args(argv)
    process = processes.setup(args.device, compile=args.compile)
    autocast, dtype = processes.autocast(process.device, args.dtype)
    # compiled: few graphs (torch.compiler.config is torch 2.6+; eager runs need none of it)
    with torch.compiler.config.patch(dynamic_sources=DYNAMIC) if process.compiled else contextlib.nullcontext():
        (run_suite if args.suite else run_task)(args, process, autocast, dtype)
    if process.compiled and process.rank == 0:  # what compiling cost, in the epochs' seconds above
        s = compile_stats()
        print(f"{process.compiled}: {s['graphs']} graphs compiled in {s['seconds']:.1f} s, {s['breaks']} graph breaks; "
              f"recompiled for {'; '.join(s['recompiles']) or 'nothing'}")
    processes.teardown()


if __name__ == "__main__":
    main()
