"""Files from elsewhere that are not what they claim, each refused in one line that names the file and the field:
a checkpoint's config.json and weights, tokenizer files, a data directory (meta.json, its shards), progress.json,
a suite's stored runs, eval.py's task lines; the card's decorative reads give up quietly instead of hanging. The
hostile files are edited copies of a real tiny checkpoint, tokenizer and data directory made here."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import cka
import data
import eval as eval_script
import train
from model import ModernBertConfig, ModernBertForMaskedLM
from support import hf, suite
from support.card import base_model
from support.checkpoint import checkpoint_config
from support.files import number, read_bytes, read_json, replace_file, whole
from support.tokenizer import load_tokenizer, train_bpe
from test_links import sums, within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"document {i} is about {'cells ' * (i % 5)}and {'proteins ' * (i % 3)}in the liver" for i in range(120)]
TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            local_attention=16, pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3)
FIX = "fix the file, or copy the checkpoint again from its source"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Hugging Face ModernBERT directory (no manifest: as one comes from the hub), its tokenizer, and texts."""
    d = tmp_path_factory.mktemp("hostile_files")
    (d / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    train_bpe(iter(TEXTS), 300, str(d / "tok.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(**TINY)).save_pretrained(str(d / "model"))
    shutil.copyfile(d / "tok.json", d / "model" / "tokenizer.json")
    return d


def edited(folder, tmp_path, edit=None, name="config.json"):
    """A copy of `folder` (a checkpoint, a data directory), its JSON file `name` (if any: {}) updated by `edit` (a
    dict) or put through it (a function that changes it in place or returns its new value or the file's new text)."""
    d = tmp_path / folder.name
    shutil.copytree(folder, d)
    value = json.loads((d / name).read_text()) if (d / name).exists() else {}
    value = (edit(value) if callable(edit) else value.update(edit or {})) or value
    (d / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return d


def one_line(fn):
    """fn()'s SystemExit: its message, one line (exit status 1)."""
    with pytest.raises(SystemExit) as e:
        fn()
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    return e.value.code


CONFIGS = [  # (id, the change to config.json, what the line says after "config.json"); a value of each kind of check
    ("layers 10^9", {"num_hidden_layers": 10 ** 9}, ": num_hidden_layers=1000000000 must be a whole number from 1 to "
                                                    "1,024"),
    ("no heads", {"num_attention_heads": 0}, ": num_attention_heads=0 must be a whole number from 1"),
    ("hidden_size a boolean", {"hidden_size": True}, ": hidden_size=True must be a whole number"),
    ("an odd head_dim", {"hidden_size": 30}, ": hidden_size=30 must split into num_attention_heads=2 heads of an even"),
    ("heads that do not divide", {"num_attention_heads": 3}, ": hidden_size=32 must split into num_attention_heads=3"),
    ("global every 0 layers", lambda d: d.pop("layer_types") and d.update(global_attn_every_n_layers=0),
     ": global_attn_every_n_layers=0 must be a whole number from 1"),
    ("a negative rope theta", lambda d: d.pop("rope_parameters") and d.update(global_rope_theta=-1.0),
     ": global_rope_theta=-1.0 must be a positive number"),
    ("a dropout of 1.5", {"attention_dropout": 1.5}, ": attention_dropout=1.5 must be a number in [0, 1)"),
    ("a token id that is a string", {"cls_token_id": "2"}, ": cls_token_id='2' must be a whole number"),
    ("a pooling that is none", {"classifier_pooling": "max"}, ": classifier_pooling='max' must be 'mean' or 'cls'"),
    ("labels keyed by name", {"id2label": {"a": "b"}}, ": id2label must map \"0\", \"1\", ... to label"),
    ("a problem type of another library", {"problem_type": "ranking"}, ": problem_type='ranking' must be one of"),
    ("an array", lambda d: "[1]", " holds a JSON array where a JSON object is expected"),
    ("deep", lambda d: "[" * 100_000 + "]" * 100_000, " is not JSON this code reads"),
    ("layer_types a number", {"layer_types": 5}, " layer_types is not 'global every n layers': 5"),
    ("rope_parameters an array", {"rope_parameters": [1]}, " rope_parameters must be an object"),
    ("model_type a list", {"model_type": ["bert"]}, " has model_type=['bert']; this code only reads ModernBERT"),
]


@pytest.mark.parametrize("name, edit, said", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_config_json_value_or_shape_that_is_wrong_is_one_line(ckpt, tmp_path, name, edit, said):
    d = edited(ckpt / "model", tmp_path, edit)  # eval.py's check: a model_type that is no name is not ModernBERT's
    message = one_line(lambda: eval_script.check_model(str(d), None, torch.device("cpu"), torch.float32))
    assert message.startswith(f"--model {d}: ") and f"config.json{said}" in message, message
    # a value's check: the first (only) field named, and how to fix it
    assert not said.startswith(":") or message.startswith(f"--model {d}: config.json{said}") and message.endswith(FIX)


def test_a_model_no_machine_holds_is_refused_before_it_is_allocated(ckpt, tmp_path):
    """The estimate against torch's count of a tiny model's parameters and buffers; the refusal is on the config."""
    tiny = ModernBertForMaskedLM(ModernBertConfig(**TINY))
    real = 4 * (tiny.num_params() + sum(b.numel() for b in tiny.buffers()))
    assert abs(hf.model_bytes(tiny.config) - real) <= 4 * TINY["hidden_size"]  # layer 0's attention has no norm
    d = edited(ckpt / "model", tmp_path, dict(hidden_size=65536, num_attention_heads=1024,
                                              intermediate_size=262144, num_hidden_layers=1024))
    layer = 4 * 65536 ** 2 + 3 * 65536 * 262144  # Wqkv, Wo, Wi (two branches), the MLP's Wo: 1.1e15 bytes in all
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    message = one_line(lambda: checkpoint_config(str(d), "--model m"))
    need = int(re.search(r"needs ([\d,]+) GiB in float32", message)[1].replace(",", ""))
    assert 4 * 1024 * layer / 2 ** 30 <= need <= 1.001 * 4 * 1024 * layer / 2 ** 30  # the layers, and a little more
    assert f"more than this machine's {memory / 2 ** 30:,.0f} GiB of memory; {FIX}" in message


# -----------------------------------------------------------------------------
# Weights


def cut(path):
    path.write_bytes(path.read_bytes()[:os.path.getsize(path) // 2])


def int_weights(path):
    state = load_file(path)
    key = "model.embeddings.tok_embeddings.weight"
    save_file({**state, key: (state[key] * 100).to(torch.int64)}, path)


def runs_code(path):
    """An object whose unpickling calls os.mkdir(path): what any callable in a pickle could do."""
    return type("RunsCode", (), {"__reduce__": lambda self: (os.mkdir, (str(path),))})()


def bin_of(value):
    def write(path):
        os.remove(path)
        torch.save(value, path.with_name("pytorch_model.bin"))
    return write


@pytest.mark.parametrize("damage, said", [
    (cut, "cannot load {d}/model.safetensors (SafetensorError: "),
    (int_weights, "{d}: model.embeddings.tok_embeddings.weight is int64 of shape (320, 32) but config.json implies "
                  "floating point"),
    (bin_of({"a": 1}), "{d}/pytorch_model.bin holds a dict, not named tensors"),
    (lambda p: bin_of({"extra": runs_code(p.parent / "it_ran")})(p),
     "{d}/pytorch_model.bin: refused: it holds objects other than tensors"),
    (lambda p: bin_of({"a": torch.zeros(1000)})(p) or cut(p.with_name("pytorch_model.bin")),
     "cannot load {d}/pytorch_model.bin (RuntimeError: "),
], ids=["cut in half", "integer weights", "pickle of numbers", "pickle that would run code", "pickle cut short"])
def test_weights_cut_short_or_malformed_are_one_line(ckpt, tmp_path, damage, said):
    d = edited(ckpt / "model", tmp_path)
    damage(d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        ModernBertForMaskedLM.from_pretrained(str(d))
    assert str(e.value).startswith(said.format(d=d)) and "\n" not in str(e.value), str(e.value)
    assert not (d / "it_ran").exists()  # nothing in the file ran


def test_cka_and_train_init_from_on_a_hostile_checkpoint_are_one_line(ckpt, shards, tmp_path):
    """Before: cka.py allocated until the machine ran out of memory, or ended in a traceback."""
    d = edited(ckpt / "model", tmp_path, {"num_hidden_layers": 10 ** 9})
    args = ["--pair", d, ckpt / "model", "--texts", ckpt / "texts.txt", "--n", "8", "--device", "cpu", "--out",
            tmp_path / "out"]
    layers = "config.json: num_hidden_layers=1000000000 must be a whole number"
    assert one_line(lambda: cka.main(list(map(str, args)))).startswith(f"{d}: {layers}")
    message = one_line(lambda: train.main([f"--data_dir={shards}", f"--out_dir={tmp_path / 'out'}", f"--init_from={d}",
                                           *TRAIN_ARGS[1:]]))
    assert message.startswith(f"init_from={d}: {layers}"), message
    shutil.copyfile(ckpt / "model" / "config.json", d / "config.json")
    cut(d / "model.safetensors")
    line = one_line(lambda: cka.main(list(map(str, args))))
    assert line.startswith(f"{d}: cannot load {d}/model.safetensors (SafetensorError"), line


# -----------------------------------------------------------------------------
# Tokenizer files


TOKENIZERS = [  # (id, the change to tokenizer.json, or a companion file's text; that file; what the line says)
    ("a model that is a string", lambda t: {**t, "model": "x"}, "tokenizer.json",
     "tokenizer.json is not a tokenizer.json that Hugging Face tokenizers reads"),
    ("an id of four billion", lambda t: t["model"]["vocab"].update(zz=4_000_000_000), "tokenizer.json",
     "tokenizer.json: ids up to 4,000,000,000, past any vocabulary (at most 4,194,304)"),
    ("tokenizer_config.json an array", "[1]", "tokenizer_config.json",
     "tokenizer_config.json holds a JSON array where a JSON object is expected"),
    ("a special token without content", "{\"cls_token\": {\"id\": 2}}", "tokenizer_config.json",
     "tokenizer_config.json: cls_token={'id': 2} must be a token"),
]


@pytest.mark.parametrize("name, edit, file, said", TOKENIZERS, ids=[c[0] for c in TOKENIZERS])
def test_a_tokenizer_file_of_the_wrong_shape_is_one_line(ckpt, tmp_path, name, edit, file, said):
    tok = json.loads((ckpt / "tok.json").read_text())
    if callable(edit):
        tok = edit(tok) or tok
    else:
        (tmp_path / file).write_text(edit)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / file}") and said in message and "\n" not in message, message
    if name == "a model that is a string":
        line = one_line(lambda: data.main(["--input", str(ckpt / "texts.txt"), "--tokenizer",
                                           str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out")]))
        assert line.startswith(f"--tokenizer {tmp_path / 'tokenizer.json'}: cannot load it") and \
            not (tmp_path / "out").exists()


def test_a_vocabulary_with_gaps_counts_its_largest_id(tmp_path):
    """A WordPiece vocabulary whose [MASK] is id 1000 among 8 tokens: the embedding needs 1001 rows, not 8."""
    import tokenizers
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "liver": 4, "cells": 5, "the": 6, "[MASK]": 1000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("[MASK]") == 1000
    assert ours.mask_id == 1000 and ours.vocab_size == 1001


# -----------------------------------------------------------------------------
# progress.json, a suite's stored runs, eval.py's task lines, the card's reads


@pytest.mark.parametrize("text, said", [
    ("{\"step\": \"8\", \"tokens\": 1024, \"phase\": \"main\"}", "step='8', tokens=1024 and phase='main' must be"),
    ("{\"step\": 8, \"tokens\": -1, \"phase\": \"main\"}", "tokens=-1"),
    ("{\"step\": 8, \"tokens\": 1024, \"phase\": 5}", "phase=5"),
    ("{\"step\": ", "is not valid JSON"),
    (None, "progress.json is a FIFO, not a file"),
], ids=["step a string", "tokens negative", "phase a number", "cut short", "a FIFO"])
def test_progress_json_of_another_shape_is_one_line_without_waiting(tmp_path, text, said):
    path = tmp_path / "ckpt-8" / "progress.json"
    path.parent.mkdir()
    path.write_text(text) if text else os.mkfifo(path)  # a FIFO with no writer: a blocking open would wait for ever
    e = within(30, lambda: cka.progress_of(str(path.parent))).get("error")
    assert isinstance(e, SystemExit) and str(e.code).startswith(f"{path.parent}: no readable progress.json (") \
        and said in e.code and "\n" not in e.code, e
    os.remove(path)
    path.write_text("{\"step\": 8, \"tokens\": 1024, \"phase\": \"main\"}")
    assert cka.progress_of(str(path.parent)) == {"step": 8, "tokens": 1024, "phase": "main"}


OPTIONS = {"task": "cls", "lr": 5e-5, "seed": 1}


@pytest.mark.parametrize("result, said", [
    ([1], "TypeError: "),
    ({"test": [0.5]}, "AttributeError: "),
    ({"test": {"macro_f1": 0.9, "weighted_f1": 1.5}},
     "ValueError: its test metrics {'macro_f1': 0.9, 'weighted_f1': 1.5} must be numbers in "),
], ids=["result an array", "test an array", "a metric past 1"])
def test_a_stored_run_is_used_only_in_its_own_shape(tmp_path, result, said):
    f = tmp_path / "seed1.json"
    f.write_text(json.dumps({"options": OPTIONS, "result": result}))
    done, problems = suite.finished_runs([(str(f), OPTIONS)])
    assert done == {} and len(problems) == 1 and problems[0].startswith(f"{f}: not a stored run ({said}"), problems
    result = {"test": {"macro_f1": 0.75, "weighted_f1": 0.8, "accuracy": 0.8}, "best_epoch": 3}
    suite.store_run(str(f), OPTIONS, result)
    assert suite.finished_runs([(str(f), OPTIONS)]) == ({0: result}, [])
    os.remove(f)
    os.mkfifo(f)  # no run, and not waited on
    assert within(30, lambda: suite.finished_runs([(str(f), OPTIONS)])) == {"value": ({}, [])}


def test_a_task_line_nested_too_deeply_is_one_line(tmp_path):
    lines = [json.dumps({"text": "liver", "label": 1}), "{\"text\": \"a\", \"label\": " + "[" * 100_000 + "]" * 100_000
             + "}"]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    message = one_line(lambda: eval_script.read_split(str(tmp_path / "train.jsonl"), "cls"))
    assert message.startswith(f"{tmp_path / 'train.jsonl'}:2: not a JSON line this code reads (RecursionError")


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
# A data directory made by data.py, then edited as a user (or another user of a shared filesystem) would: refused in
# one line naming the file and the field, before any work, or, for an id past the vocabulary inside a shard, at the
# step that would read it, with no checkpoint left half-written.


TRAIN_ARGS = ["--model_config={'hidden_size': 32, 'intermediate_size': 48, 'num_hidden_layers': 2, "
              "'num_attention_heads': 2, 'local_attention': 16}", "--seq_len=32", "--global_batch_size=4",
              "--micro_batch_size=2", "--tokens=768", "--warmup_tokens=0", "--decay_frac=0", "--eval_interval=100",
              "--ckpt_interval=2", "--device=cpu", "--compile=False"]


@pytest.fixture(scope="module")
def shards(ckpt):
    """A data directory as data.py makes it: the 300-token BPE, uint16 shards, meta.json."""
    data.prepare(lambda: data.read_documents([str(ckpt / "texts.txt")]), str(ckpt / "tok.json"), str(ckpt / "shards"),
                 val_docs=10)
    return ckpt / "shards"


CASES = [  # (id, the change to meta.json, or (a change, another file), what the line says)
    ("dtype uint8", {"dtype": "uint8"}, "meta.json: dtype='uint8' is not a shard format"),
    ("dtype a list", {"dtype": ["uint16"]}, "meta.json: dtype=['uint16'] is not a shard format"),
    ("vocab_size a boolean", {"vocab_size": True}, "meta.json: vocab_size=True must be"),
    ("vocab_size past uint16", {"vocab_size": 70_000},
     "meta.json: vocab_size=70000 must be a whole number from 1 to 65,536 (uint16 ids)"),
    ("a special id past the vocabulary", {"mask_id": 300}, "meta.json: mask_id=300 must be a token id below "
                                                           "vocab_size=300"),
    ("a special id that is a float", {"eos_id": 3.0}, "meta.json: eos_id=3.0 must be a token id"),
    ("a count that is negative", {"val_docs": -1}, "meta.json: val_docs=-1 must be a whole number"),
    ("a hash that is not one", {"tokenizer_sha256": 5}, "meta.json: tokenizer_sha256='5' must be"),
    ("a JSON array", lambda m: [m], "meta.json holds a JSON array where a JSON object is expected"),
    ("keys missing", lambda m: {"dtype": "uint16"}, "meta.json: lacks vocab_size, cls_id"),
    ("more train tokens counted than train.bin holds", lambda m: {**m, "train_tokens": m["train_tokens"] + 1},
     "train.bin has 3,048 bytes, but meta.json's train_tokens=1,525 ids of uint16 make 3,050"),
    ("fewer val tokens counted than val.bin holds", lambda m: {**m, "val_tokens": m["val_tokens"] - 1},
     "val.bin has 270 bytes, but meta.json's val_tokens=134 ids of uint16 make 268"),
    ("a special token that is a number", ({"mask_token": 4}, "special_tokens_map.json"),
     "special_tokens_map.json: mask_token=4 must be a token"),
]


@pytest.mark.parametrize("name, change, said", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_data_dir_is_refused_before_any_work(shards, tmp_path, name, change, said):
    d = edited(shards, tmp_path, *(change if isinstance(change, tuple) else (change, "meta.json")))
    before = sums(d)
    message = one_line(lambda: train.main([f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TRAIN_ARGS]))
    assert said in message and "data.py" in message, message  # the file, the field, the fix
    assert not (tmp_path / "out").exists() and sums(d) == before


@pytest.mark.parametrize("bad_id", [300, 65535])
def test_an_id_past_the_vocabulary_stops_the_run_before_its_step(shards, tmp_path, bad_id):
    """300: the first id past the vocabulary, an untrained row of the 320-row embedding; 65535: past the embedding.
    It sits in the first window of step 2 (data_seed 0): the run checkpoints at step 2, then stops, no temporary
    checkpoint left."""
    d = edited(shards, tmp_path, name="meta.json")
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    window = int(np.random.default_rng([0, 0]).permutation(len(ids) // 32)[2 * 4])  # 4 windows per step
    ids[window * 32 + 5] = bad_id
    ids.tofile(d / "train.bin")
    args = [f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TRAIN_ARGS, "--data_seed=0"]
    assert one_line(lambda: train.main(args)) == (
        f"{d / 'train.bin'}: holds token id {bad_id} (near token {window * 32:,}), past the vocabulary of its "
        "meta.json (vocab_size=300): the file is not what data.py wrote; prepare the data again (the checkpoints "
        "written so far are intact)")
    assert [n for n in sorted(os.listdir(tmp_path / "out")) if "ckpt" in n] == ["ckpt-2"]


# ---------------------------------------------------------------------------------------------------------------------
# support/files.py's reading rule: a regular file of a sane size, JSON of the shape its reader expects; anything else
# is a ValueError that names the file. Checked against what the operating system and the json module say.


def test_a_file_is_read_whole_up_to_its_limit_as_json_loads_reads_it(tmp_path):
    data = os.urandom(40 << 20)  # three reads of 16 MB
    (tmp_path / "f").write_bytes(data)
    assert read_bytes(str(tmp_path / "f"), len(data)) == data
    value = {"a": [1, 2.5, None, True], "b": {"c": "é"}, "x": "a" * 1000}
    (tmp_path / "x.json").write_text(json.dumps(value))
    size = os.path.getsize(tmp_path / "x.json")
    assert read_json(str(tmp_path / "x.json"), limit=size) == value
    with pytest.raises(ValueError, match=f"x.json has {size:,} bytes, more than such a file can hold \\(100\\)"):
        read_json(str(tmp_path / "x.json"), limit=100)
    (tmp_path / "y.json").write_text("[1, 2]")
    assert read_json(str(tmp_path / "y.json"), list) == [1, 2]


@pytest.mark.parametrize("text, said", [
    ("fifo", "is a FIFO, not a file"),  # no writer: an ordinary open() would wait for one for ever
    ("dir", "is a directory, not a file"),
    ("device", "is a device or a socket, not a file"),
    ("{\"a\": ", "is not valid JSON (Expecting value"),
    ("\xff\xfe{}", "is not valid JSON"),  # not UTF-8 (written as latin-1 below)
    ("[" * 100_000 + "]" * 100_000, "is not JSON this code reads: it is nested too deeply"),
    ("[1, 2]", "holds a JSON array where a JSON object is expected"),
    ("\"text\"", "holds a JSON string where a JSON object is expected"),
    ("true", "holds a JSON boolean where a JSON object is expected"),
    ("null", "holds a JSON null where a JSON object is expected"),
], ids=["fifo", "dir", "device", "cut short", "not UTF-8", "nested too deeply", "an array", "a string", "a boolean",
        "null"])
def test_what_is_no_file_or_json_of_another_shape_is_named_without_waiting(tmp_path, text, said):
    path = {"dir": str(tmp_path), "device": "/dev/null"}.get(text, str(tmp_path / "x"))
    if text == "fifo":
        os.mkfifo(path)
    elif text not in ("dir", "device"):
        (tmp_path / "x").write_bytes(text.encode("latin-1"))
    e = within(30, lambda: read_json(path)).get("error")
    assert isinstance(e, ValueError) and str(e).startswith(f"{path} {said}") and "\n" not in str(e), e


def test_whole_numbers_and_numbers_are_json_numbers_not_booleans():
    assert whole(0) and whole(768, 1, 768) and whole(10 ** 30, 0, 10 ** 31)
    assert not any(whole(v) for v in (True, False, 768.0, "768", None, -1, [1]))
    assert not whole(769, 1, 768) and not whole(0, 1)
    assert number(1e-5, 0) and number(3) and number(10 ** 400)  # a JSON integer of any size compares exactly
    assert not any(number(v) for v in (True, float("nan"), float("inf"), -float("inf"), "1", None))
    assert not number(-0.5, 0) and not number(2, 0, 1)


def test_a_file_replaced_whole_takes_the_place_of_what_a_killed_write_left(tmp_path):
    """replace_file writes PATH.tmp, then renames it over PATH: a PATH.tmp a kill left half written goes first."""
    (tmp_path / "config.json.tmp").write_text('{"half": ')
    replace_file(str(tmp_path / "config.json"), '{"whole": true}')
    assert read_json(str(tmp_path / "config.json")) == {"whole": True} and os.listdir(tmp_path) == ["config.json"]
