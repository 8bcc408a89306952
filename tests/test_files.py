"""Files from elsewhere that are not what they claim, each refused in one line that names the file and the field:
a checkpoint's config.json (wrong types, sizes that no machine holds, heads that do not split), its weights (cut
short, malformed, of another type), tokenizer files of the wrong shape, progress.json (cka.py --runs), a suite's
stored runs, eval.py's task lines; and the reads that only decorate (the card's base model) give up quietly
instead of hanging. The hostile files are built here from a real tiny checkpoint and tokenizer."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

import cka
import eval as eval_script
import numpy as np
import train
from data import prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM
from support import hf, suite
from support.card import base_model
from support.checks import checkpoint_config
from support.files import number, read_bytes, read_json, whole
from support.tokenizer import TiktokenBPE, load_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"document {i} is about {'cells ' * (i % 5)}and {'proteins ' * (i % 3)}in the liver" for i in range(40)]
TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            local_attention=16, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Hugging Face ModernBERT directory (no manifest: as one comes from the hub) with its tokenizer, and texts."""
    d = tmp_path_factory.mktemp("hostile_files")
    (d / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    train_bpe(iter(TEXTS), 300, str(d / "tok.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(**TINY)).save_pretrained(str(d / "model"))
    shutil.copyfile(d / "tok.json", d / "model" / "tokenizer.json")
    return d


def edited(ckpt, tmp_path, edit):
    """A copy of the checkpoint whose config.json dict d went through edit(d) (which may return a replacement)."""
    d = tmp_path / "model"
    shutil.copytree(ckpt / "model", d)
    config = json.loads((d / "config.json").read_text())
    config = edit(config) or config
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def one_line(fn):
    """fn()'s SystemExit: its message, one line (exit status 1)."""
    with pytest.raises(SystemExit) as e:
        fn()
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    return e.value.code


def without(*keys):
    """An edit that drops the transformers-5 keys, so that the old ones (global_attn_every_n_layers, the thetas)
    are what the file says."""
    return lambda d: [d.pop(k) for k in keys] and None


# (name, edit of the config.json dict, what the line must say after "config.json: ")
CONFIGS = [
    ("layers 10^9", lambda d: d.update(num_hidden_layers=10 ** 9), "num_hidden_layers=1000000000 must be a whole "
                                                                   "number from 1 to 1,024"),
    ("no heads", lambda d: d.update(num_attention_heads=0), "num_attention_heads=0 must be a whole number from 1"),
    ("hidden_size a string", lambda d: d.update(hidden_size="32"), "hidden_size='32' must be a whole number"),
    ("hidden_size a boolean", lambda d: d.update(hidden_size=True), "hidden_size=True must be a whole number"),
    ("hidden_size a float", lambda d: d.update(hidden_size=32.0), "hidden_size=32.0 must be a whole number"),
    ("an odd head_dim", lambda d: d.update(hidden_size=30), "hidden_size=30 must split into num_attention_heads=2 "
                                                            "heads of an even size"),
    ("heads that do not divide", lambda d: d.update(num_attention_heads=3), "hidden_size=32 must split into "
                                                                            "num_attention_heads=3 heads"),
    ("local_attention negative", lambda d: d.update(local_attention=-4), "local_attention=-4 must be a whole number"),
    ("vocab_size negative", lambda d: d.update(vocab_size=-1), "vocab_size=-1 must be a whole number from 1"),
    ("positions 10^12", lambda d: d.update(max_position_embeddings=10 ** 12), "max_position_embeddings="
                                                                               "1000000000000 must be a whole number"),
    ("intermediate_size 10^7", lambda d: d.update(intermediate_size=10 ** 7), "intermediate_size=10000000 must be"),
    ("global every 0 layers", lambda d: without("layer_types")(d) or d.update(global_attn_every_n_layers=0),
     "global_attn_every_n_layers=0 must be a whole number from 1"),
    ("a negative rope theta", lambda d: without("rope_parameters")(d) or d.update(global_rope_theta=-1.0),
     "global_rope_theta=-1.0 must be a positive number"),
    ("norm_eps a string", lambda d: d.update(norm_eps="x"), "norm_eps='x' must be a positive number"),
    ("a dropout of 1.5", lambda d: d.update(attention_dropout=1.5), "attention_dropout=1.5 must be a number in [0, 1)"),
    ("a token id that is a string", lambda d: d.update(cls_token_id="2"), "cls_token_id='2' must be a whole number"),
    ("a pooling that is none", lambda d: d.update(classifier_pooling="max"), "classifier_pooling='max' must be "
                                                                            "'mean' or 'cls'"),
    ("labels keyed by name", lambda d: d.update(id2label={"a": "b"}), "id2label must map \"0\", \"1\", ... to label"),
    ("a problem type of another library", lambda d: d.update(problem_type="ranking"), "problem_type='ranking' must "
                                                                                     "be one of"),
]


@pytest.mark.parametrize("name, edit, said", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_config_json_value_of_the_wrong_type_or_size_is_one_line(ckpt, tmp_path, name, edit, said):
    d = edited(ckpt, tmp_path, edit)
    message = one_line(lambda: checkpoint_config(str(d), f"--model {d}"))
    assert message.startswith(f"--model {d}: config.json: ") and said in message, message
    assert message.endswith("fix the file, or copy the checkpoint again from its source")


@pytest.mark.parametrize("name, edit, said", [
    ("an array", lambda d: "[1]", "config.json holds a JSON array where a JSON object is expected"),
    ("not JSON", lambda d: "{\"hidden_size\": ", "config.json is not valid JSON"),
    ("nested too deeply", lambda d: "[" * 100_000 + "]" * 100_000, "config.json is not JSON this code reads"),
    ("layer_types a number", lambda d: d.update(layer_types=5), "config.json layer_types is not 'global every n "
                                                                "layers': 5"),
    ("rope_parameters an array", lambda d: d.update(rope_parameters=[1]), "config.json rope_parameters must be an "
                                                                          "object"),
    ("rope_parameters of a number", lambda d: d.update(rope_parameters={"full_attention": 3}),
     "config.json rope_parameters must be an object"),
    ("model_type a list", lambda d: d.update(model_type=["bert"]), "config.json has model_type=['bert']; this code "
                                                                   "only reads ModernBERT"),
], ids=["array", "not JSON", "deep", "layer_types a number", "rope_parameters an array", "rope of a number",
        "model_type a list"])
def test_a_config_json_of_another_shape_is_one_line(ckpt, tmp_path, name, edit, said):
    d = edited(ckpt, tmp_path, edit)
    assert said in one_line(lambda: checkpoint_config(str(d), f"--model {d}"))


def test_a_model_no_machine_holds_is_refused_before_it_is_allocated(ckpt, tmp_path):
    """1,024 layers of width 65,536: 1.1e15 bytes in float32. The estimate is checked against torch's own count of
    a tiny model's parameters and buffers, and the refusal comes before any allocation (the check is on the config)."""
    tiny = ModernBertForMaskedLM(ModernBertConfig(**TINY))
    real = 4 * (tiny.num_params() + sum(b.numel() for b in tiny.buffers()))
    assert abs(hf.model_bytes(tiny.config) - real) <= 4 * TINY["hidden_size"]  # layer 0's attention has no norm
    d = edited(ckpt, tmp_path, lambda c: c.update(hidden_size=65536, num_attention_heads=1024, intermediate_size=262144,
                                                  num_hidden_layers=1024))
    layer = 4 * 65536 ** 2 + 3 * 65536 * 262144  # Wqkv, Wo, Wi (two branches), the MLP's Wo: 1.1e15 bytes in all
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    message = one_line(lambda: checkpoint_config(str(d), "--model m"))
    need = int(re.search(r"needs ([\d,]+) GiB in float32", message)[1].replace(",", ""))
    assert 4 * 1024 * layer / 2 ** 30 <= need <= 1.001 * 4 * 1024 * layer / 2 ** 30  # the layers, and a little more
    assert f"more than this machine's {memory / 2 ** 30:,.0f} GiB of memory" in message


def test_train_init_from_a_hostile_config_is_one_line(ckpt, tmp_path):
    d = edited(ckpt, tmp_path, lambda c: c.update(num_hidden_layers=10 ** 9))
    data = tmp_path / "data"
    data.mkdir()
    (np.arange(2000) % 300).astype(np.uint16).tofile(data / "train.bin")
    (np.arange(640) % 300).astype(np.uint16).tofile(data / "val.bin")
    (data / "meta.json").write_text(json.dumps(dict(dtype="uint16", vocab_size=300, cls_id=2, sep_id=3, pad_id=0,
                                                    mask_id=4, eos_id=3)))
    message = one_line(lambda: train.main([f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", f"--init_from={d}",
                                           "--seq_len=32", "--global_batch_size=4", "--micro_batch_size=2",
                                           "--device=cpu"]))
    assert message.startswith(f"init_from={d}: config.json: num_hidden_layers=1000000000 must be a whole number")


def test_cka_on_a_config_that_would_allocate_without_end_is_one_line(ckpt, tmp_path):
    """Before: cka.py allocated until the machine ran out of memory."""
    d = edited(ckpt, tmp_path, lambda c: c.update(num_hidden_layers=10 ** 9))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "cka.py"), "--pair", str(d), str(ckpt / "model"),
                        "--texts", str(ckpt / "texts.txt"), "--n", "8", "--device", "cpu", "--out", "out"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"{d}: config.json: num_hidden_layers=1000000000 must be")


# -----------------------------------------------------------------------------
# Weights


def cut(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def garbage(path):
    path.write_bytes(b"\x00" * 8 + b"not a header" * 100)


def int_weights(path):
    state = load_file(path)
    key = "model.embeddings.tok_embeddings.weight"
    save_file({**state, key: (state[key] * 100).to(torch.int64)}, path)


def bin_of(value):
    def write(path):
        os.remove(path)
        torch.save(value, path.with_name("pytorch_model.bin"))
    return write


@pytest.mark.parametrize("name, damage, said", [
    ("cut in half", cut, "cannot load {d}/model.safetensors (SafetensorError: "),
    ("a garbage header", garbage, "cannot load {d}/model.safetensors (SafetensorError: "),
    ("empty", lambda p: p.write_bytes(b""), "cannot load {d}/model.safetensors (SafetensorError: "),
    ("integer weights", int_weights, "{d}: model.embeddings.tok_embeddings.weight is int64 of shape (320, 32) but "
                                     "config.json implies floating point"),
    ("a pickle of a list", bin_of([1, 2]), "{d}/pytorch_model.bin holds a list, not named tensors"),
    ("a pickle of numbers", bin_of({"a": 1}), "{d}/pytorch_model.bin holds a dict, not named tensors"),
    ("a pickle cut short", lambda p: bin_of({"a": torch.zeros(1000)})(p) or cut(p.with_name("pytorch_model.bin")),
     "cannot load {d}/pytorch_model.bin (RuntimeError: "),
], ids=["cut in half", "garbage header", "empty", "integer weights", "pickle of a list", "pickle of numbers",
        "pickle cut short"])
def test_weights_cut_short_or_malformed_are_one_line(ckpt, tmp_path, name, damage, said):
    d = edited(ckpt, tmp_path, lambda c: None)
    damage(d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        ModernBertForMaskedLM.from_pretrained(str(d))
    assert str(e.value).startswith(said.format(d=d)) and "\n" not in str(e.value), str(e.value)


def test_cka_on_truncated_weights_is_one_line(ckpt, tmp_path):
    d = edited(ckpt, tmp_path, lambda c: None)
    cut(d / "model.safetensors")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "cka.py"), "--pair", str(ckpt / "model"), str(d),
                        "--texts", str(ckpt / "texts.txt"), "--n", "8", "--device", "cpu", "--out", "out"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"{d}: cannot load {d}/model.safetensors (SafetensorError")


# -----------------------------------------------------------------------------
# Tokenizer files


def tokenizer_edit(ckpt, tmp_path, edit, name="tokenizer.json"):
    """A folder with the tokenizer (its dict d through edit(d), which may return a replacement) and, for a
    companion file `name`, that file as edit returns it."""
    d = tmp_path / "tok"
    d.mkdir()
    tok = json.loads((ckpt / "tok.json").read_text())
    if name == "tokenizer.json":
        tok = edit(tok) or tok
    else:
        (d / name).write_text(edit(None))
    (d / "tokenizer.json").write_text(tok if isinstance(tok, str) else json.dumps(tok))
    return d


def add_merge(tok, a, b):
    for token in (a, b, a + b):
        tok["model"]["vocab"].setdefault(token, len(tok["model"]["vocab"]))
    tok["model"]["merges"].append([a, b])


TOKENIZERS = [
    ("an array", lambda t: "[1, 2]", "tokenizer.json", "tokenizer.json holds a JSON array where a JSON object"),
    ("a model that is a string", lambda t: {**t, "model": "x"}, "tokenizer.json",
     "tokenizer.json is not a tokenizer.json that Hugging Face tokenizers reads"),
    ("nested too deeply", lambda t: "{\"a\": " * 100_000 + "1" + "}" * 100_000, "tokenizer.json",
     "tokenizer.json is not JSON this code reads: it is nested too deeply"),
    ("added tokens that are a string", lambda t: {**t, "added_tokens": "x"}, "tokenizer.json",
     "tokenizer.json is not a tokenizer.json that Hugging Face tokenizers reads"),
    ("a merge with a character no byte stands for", lambda t: add_merge(t, "l", "文"), "tokenizer.json",
     "tokenizer.json: the merge ['l', '文'] is not of byte-level BPE tokens"),
    ("an id of four billion", lambda t: t["added_tokens"][0].update(id=4_000_000_000), "tokenizer.json",
     "tokenizer.json: ids up to 4,000,000,000, more than a vocabulary holds (at most 4,194,304)"),
    ("tokenizer_config.json an array", lambda _: "[1]", "tokenizer_config.json",
     "tokenizer_config.json holds a JSON array where a JSON object is expected"),
    ("a special token that is a number", lambda _: "{\"mask_token\": 4}", "special_tokens_map.json",
     "special_tokens_map.json: mask_token=4 must be a token"),
    ("a special token without content", lambda _: "{\"cls_token\": {\"id\": 2}}", "tokenizer_config.json",
     "tokenizer_config.json: cls_token={'id': 2} must be a token"),
]


@pytest.mark.parametrize("name, edit, file, said", TOKENIZERS, ids=[c[0] for c in TOKENIZERS])
def test_a_tokenizer_file_of_the_wrong_shape_is_one_line(ckpt, tmp_path, name, edit, file, said):
    d = tokenizer_edit(ckpt, tmp_path, edit, file)
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(d))
    assert str(e.value).startswith(f"{d / file}") and said in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_data_py_with_a_tokenizer_of_the_wrong_shape_is_one_line(ckpt, tmp_path):
    d = tokenizer_edit(ckpt, tmp_path, lambda t: {**t, "model": "x"})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "--input", str(ckpt / "texts.txt"),
                        "--tokenizer", str(d / "tokenizer.json"), "--out", "out", "--val_docs", "5"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    assert r.stderr.strip().splitlines()[-1].startswith(f"--tokenizer {d / 'tokenizer.json'}: cannot load it")


def test_a_vocabulary_with_gaps_counts_its_largest_id(tmp_path):
    """A WordPiece vocabulary whose [MASK] is id 1000 among 8 tokens: Hugging Face gives 1000 for [MASK], so the
    embedding needs 1001 rows, not 8 (the number of tokens)."""
    import tokenizers
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "liver": 4, "cells": 5, "the": 6, "[MASK]": 1000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("[MASK]") == 1000
    assert ours.mask_id == 1000 and ours.vocab_size == 1001 and not isinstance(ours, TiktokenBPE)


# -----------------------------------------------------------------------------
# progress.json, a suite's stored runs, eval.py's task lines, the card's reads


@pytest.mark.parametrize("text, said", [
    ("[3]", "holds a JSON array where a JSON object is expected"),
    ("{\"step\": \"8\", \"tokens\": 1024, \"phase\": \"main\"}", "step='8', tokens=1024 and phase='main' must be"),
    ("{\"step\": 8, \"tokens\": -1, \"phase\": \"main\"}", "tokens=-1"),
    ("{\"step\": 8, \"tokens\": 1024, \"phase\": 5}", "phase=5"),
    ("{\"step\": 8.0}", "step=8.0"),
    ("{\"step\": ", "is not valid JSON"),
], ids=["array", "step a string", "tokens negative", "phase a number", "step a float", "cut short"])
def test_progress_json_of_another_shape_is_one_line(tmp_path, text, said):
    (tmp_path / "ckpt-8").mkdir()
    (tmp_path / "ckpt-8" / "progress.json").write_text(text)
    message = one_line(lambda: cka.progress_of(str(tmp_path / "ckpt-8")))
    assert message.startswith(f"{tmp_path / 'ckpt-8'}: no readable progress.json (") and said in message, message
    (tmp_path / "ckpt-8" / "progress.json").write_text("{\"step\": 8, \"tokens\": 1024, \"phase\": \"main\"}")
    assert cka.progress_of(str(tmp_path / "ckpt-8")) == {"step": 8, "tokens": 1024, "phase": "main"}


def test_a_progress_json_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    (tmp_path / "final").mkdir()
    os.mkfifo(tmp_path / "final" / "progress.json")
    out = within(30, lambda: cka.progress_of(str(tmp_path / "final")))
    assert isinstance(out.get("error"), SystemExit) and "progress.json is a FIFO, not a file" in str(out["error"])


OPTIONS = {"task": "cls", "lr": 5e-5, "seed": 1}


@pytest.mark.parametrize("stored, said", [
    ([1, 2], "not a stored run (ValueError: {f} holds a JSON array where a JSON object is expected)"),
    ({"options": OPTIONS, "result": [1]}, "not a stored run (TypeError: "),
    ({"options": OPTIONS, "result": {"test": [0.5]}}, "not a stored run (AttributeError: "),
    ({"options": OPTIONS, "result": {"test": {"macro_f1": "0.9", "weighted_f1": 0.9}}},
     "not a stored run (ValueError: its test metrics {'macro_f1': '0.9', 'weighted_f1': 0.9} must be numbers in "),
    ({"options": OPTIONS, "result": {"test": {"macro_f1": 0.9, "weighted_f1": 1.5}}},
     "not a stored run (ValueError: its test metrics {'macro_f1': 0.9, 'weighted_f1': 1.5} must be numbers in "),
    ("[" * 100_000 + "]" * 100_000, "not a stored run (ValueError: {f} is not JSON this code reads"),
], ids=["array", "result an array", "test an array", "a metric a string", "a metric past 1", "deep"])
def test_a_stored_run_of_another_shape_is_named_not_used(tmp_path, stored, said):
    f = tmp_path / "seed1.json"
    f.write_text(stored if isinstance(stored, str) else json.dumps(stored))
    done, problems = suite.finished_runs([(str(f), OPTIONS)])
    assert done == {} and len(problems) == 1 and problems[0].startswith(f"{f}: " + said.replace("{f}", str(f))), \
        problems


def test_a_stored_run_that_is_a_fifo_is_no_run_and_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "seed1.json")
    assert within(30, lambda: suite.finished_runs([(str(tmp_path / "seed1.json"), OPTIONS)])) == {"value": ({}, [])}


def test_a_stored_run_of_the_right_shape_is_used(tmp_path):
    result = {"test": {"macro_f1": 0.75, "weighted_f1": 0.8, "accuracy": 0.8}, "best_epoch": 3}
    suite.store_run(str(tmp_path / "seed1.json"), OPTIONS, result)
    assert suite.finished_runs([(str(tmp_path / "seed1.json"), OPTIONS)]) == ({0: result}, [])


def test_a_task_line_nested_too_deeply_is_one_line(tmp_path):
    lines = [json.dumps({"text": "liver", "label": 1}), "{\"text\": \"a\", \"label\": " + "[" * 100_000 + "]" * 100_000
             + "}"]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    message = one_line(lambda: eval_script.read_split(str(tmp_path / "train.jsonl"), "cls"))
    assert message.startswith(f"{tmp_path / 'train.jsonl'}:2: not a JSON line this code reads (RecursionError")


def test_eval_on_a_config_json_with_a_model_type_that_is_no_name_is_one_line(ckpt, tmp_path):
    d = edited(ckpt, tmp_path, lambda c: c.update(model_type=["bert"]))
    message = one_line(lambda: eval_script.check_model(str(d), None, torch.device("cpu"), torch.float32))
    assert message.startswith(f"--model {d}: config.json has model_type=['bert']; this code only reads ModernBERT")


@pytest.mark.parametrize("config, fifo", [("[1]", False), ("{\"_name_or_path\": 5}", False), ("{}", True)],
                         ids=["config an array", "a name that is a number", "README.md a FIFO"])
def test_the_cards_base_model_gives_up_quietly_on_files_it_cannot_use(tmp_path, config, fifo):
    (tmp_path / "config.json").write_text(config)
    if fifo:
        os.mkfifo(tmp_path / "README.md")
    assert within(30, lambda: base_model(str(tmp_path))) == {"value": None}
    (tmp_path / "config.json").write_text("{\"_name_or_path\": \"answerdotai/ModernBERT-base\"}")
    assert base_model(str(tmp_path)) == "answerdotai/ModernBERT-base"


# ---------------------------------------------------------------------------------------------------------------------
# A data directory from elsewhere, broken or hostile: each is refused in one line that names the file and the
# field, before any work (nothing allocated, nothing written), or, for an id past the vocabulary inside a shard,
# at the step that would read it, with no checkpoint directory left half-written. The data directories are made
# by data.py here, then edited as a user (or another user of a shared filesystem) would.


CORPUS = [f"document {i} is about {'cells ' * (i % 5)}and {'proteins ' * (i % 3)}in the liver" for i in range(120)]
TRAIN_ARGS = ["--model_config={'hidden_size': 32, 'intermediate_size': 48, 'num_hidden_layers': 2, "
        "'num_attention_heads': 2, 'local_attention': 16}", "--seq_len=32", "--global_batch_size=4",
        "--micro_batch_size=2", "--tokens=768", "--warmup_tokens=0", "--decay_frac=0", "--eval_interval=100",
        "--ckpt_interval=2", "--device=cpu", "--compile=False"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A data directory as data.py makes it: a 300-token BPE, uint16 shards, meta.json."""
    d = tmp_path_factory.mktemp("hostile_data")
    (d / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
    train_bpe(iter(CORPUS), 300, str(d / "tok.json"))
    prepare(lambda: read_documents([str(d / "corpus.txt")]), str(d / "tok.json"), str(d / "shards"), val_docs=10)
    return d / "shards"


def snapshot(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy(shards, tmp_path, meta_edit=None, files=None):
    """A copy of the data directory, its meta.json edited by meta_edit(meta) -> meta (or replaced by text), other
    files written from `files` (name -> text)."""
    d = tmp_path / "data"
    shutil.copytree(shards, d)
    if meta_edit is not None:
        meta = json.loads((d / "meta.json").read_text())
        edited = meta_edit(meta)
        (d / "meta.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    for name, text in (files or {}).items():
        (d / name).write_text(text)
    return d


def refusal(argv):
    """train.py's SystemExit for argv, run in this process: its message (the one line a user reads, exit code 1)."""
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code  # one line, exit status 1
    return e.value.code


# (name, meta.json edit, files to write, what the line must say)
CASES = [
    ("dtype object", lambda m: {**m, "dtype": "object"}, {}, "meta.json: dtype='object' is not a shard format"),
    ("dtype float64", lambda m: {**m, "dtype": "float64"}, {}, "meta.json: dtype='float64' is not a shard format"),
    ("dtype uint8", lambda m: {**m, "dtype": "uint8"}, {}, "meta.json: dtype='uint8' is not a shard format"),
    ("dtype a list", lambda m: {**m, "dtype": ["uint16"]}, {}, "meta.json: dtype=['uint16'] is not a shard format"),
    ("vocab_size negative", lambda m: {**m, "vocab_size": -5}, {},
     "meta.json: vocab_size=-5 must be a whole number from 1 to 65,536 (uint16 ids)"),
    ("vocab_size a string", lambda m: {**m, "vocab_size": "300"}, {}, "meta.json: vocab_size='300' must be"),
    ("vocab_size a boolean", lambda m: {**m, "vocab_size": True}, {}, "meta.json: vocab_size=True must be"),
    ("vocab_size past uint16", lambda m: {**m, "vocab_size": 70_000}, {},
     "meta.json: vocab_size=70000 must be a whole number from 1 to 65,536 (uint16 ids)"),
    ("a special id past the vocabulary", lambda m: {**m, "mask_id": 300}, {},
     "meta.json: mask_id=300 must be a token id below vocab_size=300"),
    ("a special id that is a float", lambda m: {**m, "eos_id": 3.0}, {}, "meta.json: eos_id=3.0 must be a token id"),
    ("a count that is negative", lambda m: {**m, "val_docs": -1}, {}, "meta.json: val_docs=-1 must be a whole number"),
    ("a hash that is not one", lambda m: {**m, "tokenizer_sha256": 5}, {}, "meta.json: tokenizer_sha256='5' must be"),
    ("not JSON", lambda m: "{\"dtype\": ", {}, "meta.json is not valid JSON"),
    ("a JSON array", lambda m: [m], {}, "meta.json holds a JSON array where a JSON object is expected"),
    ("nested too deeply", lambda m: "[" * 100_000 + "]" * 100_000, {}, "meta.json is not JSON this code reads"),
    ("keys missing", lambda m: {"dtype": "uint16"}, {}, "meta.json: lacks vocab_size, cls_id"),
    ("more train tokens counted than train.bin holds", lambda m: {**m, "train_tokens": m["train_tokens"] + 1}, {},
     "train.bin has 3,048 bytes, but meta.json's train_tokens=1,525 ids of uint16 make 3,050"),
    ("fewer val tokens counted than val.bin holds", lambda m: {**m, "val_tokens": m["val_tokens"] - 1}, {},
     "val.bin has 270 bytes, but meta.json's val_tokens=134 ids of uint16 make 268"),
    ("tokenizer_config.json an array", None, {"tokenizer_config.json": "[1]"},
     "tokenizer_config.json holds a JSON array where a JSON object is expected"),
    ("special_tokens_map.json cut short", None, {"special_tokens_map.json": "{\"mask_token\": "},
     "special_tokens_map.json is not valid JSON"),
    ("a special token that is a number", None, {"special_tokens_map.json": "{\"mask_token\": 4}"},
     "special_tokens_map.json: mask_token=4 must be a token"),
]


@pytest.mark.parametrize("name, meta_edit, files, said", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_data_dir_is_refused_before_any_work(shards, tmp_path, name, meta_edit, files, said):
    d = copy(shards, tmp_path, meta_edit, files)
    before = snapshot(d)
    message = refusal([f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TRAIN_ARGS])
    assert said in message and "data.py" in message, message  # the file, the field, the fix
    assert not (tmp_path / "out").exists() and snapshot(d) == before


def test_a_meta_json_that_is_a_fifo_is_refused_not_waited_on(shards, tmp_path):
    d = copy(shards, tmp_path)
    os.remove(d / "meta.json")
    os.mkfifo(d / "meta.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TRAIN_ARGS],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "meta.json is a FIFO, not a file" in r.stderr and "Traceback" not in r.stderr


def test_a_dtype_that_would_crash_the_process_is_one_line(shards, tmp_path):
    """dtype "object" over a train.bin of whole 8-byte items: numpy would map raw bytes as Python objects."""
    d = copy(shards, tmp_path, lambda m: {**m, "dtype": "object"})
    os.truncate(d / "train.bin", os.path.getsize(d / "train.bin") // 8 * 8)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TRAIN_ARGS],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])  # not a signal (negative), not a traceback (still 1)
    assert r.stderr.strip().splitlines()[-1].startswith(f"{d / 'meta.json'}: dtype='object' is not a shard format")
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad_id", [300, 65535])
def test_an_id_past_the_vocabulary_stops_the_run_before_its_step(shards, tmp_path, bad_id):
    """300 is the first id past a 300-token vocabulary; the model's embedding has 320 rows (a multiple of 64), so
    it would train on an untrained row without a word; 65535 would index past the embedding. The id sits in the
    first window of step 2 (the loader's order for data_seed 0): the run checkpoints at step 2, then stops at the
    step that reads it, with its checkpoint and no temporary one."""
    d = copy(shards, tmp_path)
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    window = int(np.random.default_rng([0, 0]).permutation(len(ids) // 32)[2 * 4])  # 4 windows per step
    ids[window * 32 + 5] = bad_id
    ids.tofile(d / "train.bin")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TRAIN_ARGS,
                        "--data_seed=0"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"{d / 'train.bin'}: holds token id {bad_id} (near token {window * 32:,}), past the vocabulary of its "
        "meta.json (vocab_size=300): the file is not what data.py wrote; prepare the data again (the checkpoints "
        "written so far are intact)")
    assert [n for n in sorted(os.listdir(tmp_path / "out")) if "ckpt" in n] == ["ckpt-2"]


# ---------------------------------------------------------------------------------------------------------------------
# support/files.py's reading rule: a file from elsewhere is read only if it is a regular file of a sane size, and
# JSON only if it parses to the shape its reader expects; anything else is a ValueError that names the file. Checked
# against what the operating system and the json module say of the same files.


def within(seconds, fn):
    """fn() in a thread, so that a read that blocks (a FIFO opened for reading waits for a writer) fails the test
    after `seconds` instead of hanging the run. -> what fn returned or raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still blocked after {seconds} s"
    return out


def test_a_regular_file_is_read_whole(tmp_path):
    data = os.urandom(40 << 20)  # three reads of 16 MB
    (tmp_path / "f").write_bytes(data)
    assert read_bytes(str(tmp_path / "f"), len(data)) == data


@pytest.mark.parametrize("kind, said", [("fifo", "is a FIFO, not a file"), ("dir", "is a directory, not a file"),
                                        ("device", "is a device or a socket, not a file")])
def test_what_is_no_file_is_refused_without_waiting(tmp_path, kind, said):
    path = {"fifo": str(tmp_path / "fifo"), "dir": str(tmp_path), "device": "/dev/null"}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # no writer: an ordinary open() would wait for one forever
    out = within(30, lambda: read_json(path))
    assert isinstance(out.get("error"), ValueError) and str(out["error"]) == f"{path} {said}"


def test_a_file_larger_than_its_kind_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "big.json").write_text(json.dumps({"x": "a" * 1000}))
    size = os.path.getsize(tmp_path / "big.json")
    with pytest.raises(ValueError, match=f"big.json has {size:,} bytes, more than such a file can hold \\(100\\)"):
        read_json(str(tmp_path / "big.json"), limit=100)
    assert read_json(str(tmp_path / "big.json"), limit=size) == {"x": "a" * 1000}


@pytest.mark.parametrize("text, said", [
    ("{\"a\": ", "is not valid JSON (Expecting value"),
    ("\xff\xfe{}", "is not valid JSON"),  # not UTF-8 (written as latin-1 below)
    ("[" * 100_000 + "]" * 100_000, "is not JSON this code reads: it is nested too deeply"),
    ("[1, 2]", "holds a JSON array where a JSON object is expected"),
    ("\"text\"", "holds a JSON string where a JSON object is expected"),
    ("true", "holds a JSON boolean where a JSON object is expected"),
    ("null", "holds a JSON null where a JSON object is expected"),
], ids=["cut short", "not UTF-8", "nested too deeply", "an array", "a string", "a boolean", "null"])
def test_json_of_another_shape_is_named_with_its_file(tmp_path, text, said):
    (tmp_path / "x.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        read_json(str(tmp_path / "x.json"))
    assert str(e.value).startswith(f"{tmp_path / 'x.json'} {said}") and "\n" not in str(e.value)


def test_json_of_the_expected_shape_reads_as_json_loads_does(tmp_path):
    value = {"a": [1, 2.5, None, True], "b": {"c": "é"}}
    (tmp_path / "x.json").write_text(json.dumps(value))
    assert read_json(str(tmp_path / "x.json")) == value
    (tmp_path / "y.json").write_text("[1, 2]")
    assert read_json(str(tmp_path / "y.json"), list) == [1, 2]


def test_whole_numbers_and_numbers_are_json_numbers_not_booleans():
    assert whole(0) and whole(768, 1, 768) and whole(10 ** 30, 0, 10 ** 31)
    assert not any(whole(v) for v in (True, False, 768.0, "768", None, -1, [1]))
    assert not whole(769, 1, 768) and not whole(0, 1)
    assert number(1e-5, 0) and number(3) and number(10 ** 400)  # a JSON integer of any size compares exactly
    assert not any(number(v) for v in (True, float("nan"), float("inf"), -float("inf"), "1", None))
    assert not number(-0.5, 0) and not number(2, 0, 1)
