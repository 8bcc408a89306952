"""A user's mistakes, tried as a new user would make them: each ends in one clear message and a non-zero
exit code (a SystemExit, no other exception), before any work, and leaves everything on disk as it was.

One row per mistake: the script's command line (its main(), run in a folder holding a prepared data set), a
fragment the message must contain, and the files to set up first. The folder is hashed before and after (sums)."""

import contextlib
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys

import pytest
import torch

import cka
import data
import eval as eval_py
import train
from data import prepare, read_documents
from support import checkpoint, shards
from support.tokenizer import train_bpe
from test_files import ROOT, TEXTS
from test_links import sums  # every folder and file, with each file's sha256: what "nothing on disk changed" compares
from test_train import base_ckpt, data_dir, launcher  # noqa: F401 (fixtures)
from train import Config


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder as a user has it: a corpus, two tokenizers, a prepared data set `shards`."""
    d = tmp_path_factory.mktemp("mistakes")
    (d / "corpus.txt").write_text("\n".join(TEXTS) + "\n")
    train_bpe(iter(TEXTS), 300, str(d / "tok.json"))
    train_bpe(iter(TEXTS[::-1] + ["another vocabulary entirely"] * 50), 320, str(d / "other_tok.json"))
    prepare(lambda: read_documents([str(d / "corpus.txt")]), str(d / "tok.json"), str(d / "shards"), val_docs=10)
    # its own process: one that ran here would hold run/ (its .lock's heartbeat) until this one exits
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY_RUN, "--out_dir=run"], cwd=d,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def main(folder, command):
    """Run a script's command line in `folder` as `python SCRIPT.py ARGS` would, in this process."""
    with contextlib.chdir(folder):
        SCRIPTS[command[0]](command[1:])


SCRIPTS = {"data.py": data.main, "train.py": train.main, "eval.py": eval_py.main, "cka.py": cka.main}
DATA, TRAIN = ["data.py"], ["train.py"]
CKA = ["cka.py", "--pair", "run/final", "run/final", "--texts", "corpus.txt", "--n", "8", "--device", "cpu", "--out",
       "cka"]
EVAL_ANY = ["eval.py", "--device", "cpu"]
EVAL = EVAL_ANY + ["--model", "run/final", "--out", "results"]  # the tiny run's model
CLS = EVAL + ["--task", "cls", "--data", "cls"]
NEW = ["--tokenizer", "tok.json", "--out", "new_shards"]  # data.py's arguments for a new data set
BERT_CONFIG = json.dumps({"model_type": "bert", "hidden_size": 32, "num_attention_heads": 2})  # another architecture
# A finished tiny CLM run in run/: 6 main + 2 decay steps of 4 x 32 tokens
TINY_RUN = ["--data_dir=shards", "--model_config={'hidden_size': 32, 'intermediate_size': 48, 'num_hidden_layers': 2, "
            "'num_attention_heads': 2, 'local_attention': 16}", "--seq_len=32", "--global_batch_size=4",
            "--micro_batch_size=2", f"--tokens={6 * 4 * 32}", "--warmup_tokens=0", "--decay_frac=0.34",
            "--eval_windows=4", "--device=cpu"]
NEW_RUN = TRAIN + TINY_RUN + ["--out_dir=new_run"]

# (name, files to write first: path -> text or bytes, or "@path" to copy a file or folder; command, message fragment)
ROWS = [
    ("re-run into a data set with another tokenizer, input with a bad line",
     {"bad.jsonl": '{"text": "fine"}\n{"text": 42}\n'},
     DATA + ["--input", "bad.jsonl", "--tokenizer", "other_tok.json", "--out", "shards"],
     "bad.jsonl:2: the text field holds int"),
    ("--out is a file", {"taken": "not a folder"},
     DATA + ["--input", "corpus.txt", "--tokenizer", "tok.json", "--out", "taken"], "is a file, not a directory"),
    ("an input file that does not exist", {},
     DATA + ["--input", "corpus.txt", "nope.txt", *NEW], "'nope.txt' does not exist"),
    ("an input of blank lines", {"empty.txt": "\n\n"},
     DATA + ["--input", "empty.txt", *NEW], "the input holds no documents"),
    ("an input of another format", {"x.csv": "a,b"},
     DATA + ["--input", "x.csv", *NEW], "x.csv: unknown extension '.csv'"),
    ("JSON lines without a text field", {"bad.jsonl": '{"content": "hi"}\n'},
     DATA + ["--input", "bad.jsonl", *NEW], "bad.jsonl:1: no 'text' field"),
    ("an input in latin-1", {"latin1.txt": "caf\xe9\n".encode("latin-1")},
     DATA + ["--input", "latin1.txt", *NEW], "latin1.txt: cannot be read as UTF-8 text"),
    ("an .xz input cut short", {"cut.txt.xz": lzma.compress(b"some text\n" * 100)[:40]},
     DATA + ["--input", "cut.txt.xz", *NEW], "cut.txt.xz: cannot be read as xz-compressed UTF-8 text"),
    ("bpe:N with no number", {},
     DATA + ["--input", "corpus.txt", "--tokenizer", "bpe:big", "--out", "new_shards"], "write bpe:N"),
    ("a tokenizer path that does not exist", {},
     DATA + ["--input", "corpus.txt", "--tokenizer", "tokens/tok.json", "--out", "new_shards"],
     "--tokenizer tokens/tok.json: cannot load it"),
    ("no validation documents", {}, DATA + ["--input", "corpus.txt", *NEW, "--val_docs", "0"], "must be at least 1"),
    ("a data set whose tokenizer.json was replaced",
     {"swapped": "@shards", "swapped/tokenizer.json": "@other_tok.json"},
     TRAIN + ["--data_dir=swapped", "--out_dir=run", "--device=cpu"],
     "is not the tokenizer the shards of swapped were made with"),
    ("resuming with another seq_len and seed", {},
     TRAIN + TINY_RUN + ["--out_dir=run", "--seq_len=16", "--seed=3"], "--resume_changes=seq_len,seed"),
    ("a phase of 0 tokens", {}, NEW_RUN + ["--tokens=0"], "a phase needs a positive length"),
    ("a model_config key with a typo", {}, NEW_RUN + ["--model_config={'hidden_sise': 32}"],
     "model_config: unknown key(s) hidden_sise; ModernBertConfig has vocab_size, hidden_size"),
    ("a hidden size that the heads do not divide", {},
     NEW_RUN + ["--model_config={'hidden_size': 30, 'num_attention_heads': 4}"],
     "hidden_size=30 must split into num_attention_heads=4 heads of an even size"),
    ("an evaluation interval of 0 and max_ckpts 0", {}, NEW_RUN + ["--eval_interval=0", "--max_ckpts=0"],
     "eval_interval=0 must be positive; max_ckpts=0 must be positive"),
    ("a torch.compile backend that does not exist", {}, NEW_RUN + ["--compile=inductr"],
     "compile='inductr': choose auto, True, False or a torch.compile backend, e.g. inductor or aot_eager"),
    ("betas with one value, a negative weight decay", {}, NEW_RUN + ["--betas=(0.9,)", "--weight_decay=-1"],
     "weight_decay=-1.0 must be 0 or more; betas=(0.9,) must be two numbers in [0, 1)"),
    *([("a CUDA device on a machine without one", {}, NEW_RUN + ["--device=cuda"],
        "device='cuda': PyTorch sees no CUDA GPU here")] if not torch.cuda.is_available() else []),
    ("data.py given a folder as input", {}, DATA + ["--input", "shards", *NEW], "input file 'shards' is a directory"),
    ("a mixture with fewer weights than input files", {},
     DATA + ["--input", "corpus.txt", "corpus.txt", "--weights", "0.7", *NEW],
     "--weights has 1 value(s) for 2 --input file(s): give one weight per file"),
    ("a mixture weight of 0", {}, DATA + ["--input", "corpus.txt", "corpus.txt", "--weights", "1", "0", *NEW],
     "--weights 1 0: every weight must be a positive number"),
    ("--tokens without --weights", {}, DATA + ["--input", "corpus.txt", "--tokens", "10B", *NEW],
     "--tokens and --seed size and order a mixture: give --weights too"),
    ("--tokens that is not a number", {}, DATA + ["--input", "corpus.txt", "--weights", "1", "--tokens", "lots", *NEW],
     "'lots' is not a positive token count"),
    ("a mixture source of one document", {"one.txt": "a single document\n"},
     DATA + ["--input", "corpus.txt", "one.txt", "--weights", "0.9", "0.1", "--val_docs", "2", *NEW],
     "one.txt has 1 document(s), too few to give one to training beside its 1 validation document(s)"),
    ("a mixture whose token budget leaves a source no document", {},
     DATA + ["--input", "corpus.txt", "corpus.txt", "--weights", "0.999", "0.001", "--tokens", "400",
             "--val_docs", "2", *NEW],
     "its share (0 tokens) is too small for one of its documents; raise --tokens or its weight"),
    ("eval.py --tokenizer that does not exist", {},
     CLS + ["--tokenizer", "nope.json"], "--tokenizer nope.json: tokenizer 'nope.json' not found"),
    ("cka.py --n 2", {}, CKA + ["--n", "2"], "--n 2: CKA needs at least 4 texts"),
    ("cka.py --max_len beyond the model's positions", {}, CKA + ["--max_len", "9000"],
     "--max_len 9000 is beyond run/final's max_position_embeddings=8192: pass --max_len 8192 or less"),
    ("cka.py --out is a file", {"taken": "not a folder"}, CKA + ["--out", "taken"], "--out=taken: is a file"),
    ("cka.py --pair with a path that is not a checkpoint", {},
     [*CKA[:2], "run/final", "shards", *CKA[4:]], "shards: not a checkpoint directory (no config.json)"),
    ("cka.py --pair with a BERT checkpoint", {"bert/config.json": BERT_CONFIG, "bert/tokenizer.json": "{}"},
     [*CKA[:2], "run/final", "bert", *CKA[4:]], "bert: config.json has model_type='bert'; this code only reads"),
    ("eval.py --model a BERT checkpoint", {"bert/config.json": BERT_CONFIG},
     EVAL_ANY + ["--model", "bert", "--tokenizer", "tok.json", "--task", "cls", "--data", "cls", "--out", "results"],
     "--model bert: config.json has model_type='bert'; this code only reads ModernBERT"),
    ("cka.py --runs with a checkpoint instead of a run", {},
     [CKA[0], "--runs", "run/final", "run", *CKA[4:]], "run/final holds no ckpt-STEP or final checkpoint"),
    ("eval.py --out is a file", {"taken": "not a folder"},
     CLS + ["--out", "taken"], "--out=taken: is a file, not a directory"),
    ("eval.py --suite --out is a file", {"taken": "not a folder", "s.py": "seeds = [1]\ntasks = []\n"},
     EVAL_ANY + ["--suite", "s.py", "--models", "run/final", "--out", "taken"],
     "--out=taken: is a file, not a directory"),
    ("NER tags shorter than the tokens",
     {"ner/train.jsonl": '{"tokens": ["a", "b"], "tags": ["O", "O"]}\n{"tokens": ["c", "d"], "tags": ["O"]}\n'},
     EVAL + ["--task", "ner", "--data", "ner"],
     "ner/train.jsonl:2: 2 tokens but 1 tags"),
    ("a class label that is a list", {"cls/train.jsonl": '{"text": "liver", "label": ["a", "b"]}\n'},
     CLS, "cls/train.jsonl:1: label ['a', 'b'] must be one class name or number (for several, use --task multilabel)"),
    ("multi-label labels that are a string", {"ml/train.jsonl": '{"text": "liver", "labels": "a"}\n'},
     EVAL + ["--task", "multilabel", "--data", "ml"], "ml/train.jsonl:1: labels 'a' must be a list"),
    ("labels 1 and 1.0 in one file",
     {"cls/train.jsonl": '{"text": "liver", "label": 1}\n{"text": "cells", "label": 0}\n'
                         '{"text": "proteins", "label": 1.0}\n'},
     CLS, "cls/train.jsonl:3: label 1.0 is label 1 (line 1) written another way"),
    ("a null text to fine-tune on", {"cls/train.jsonl": '{"text": "liver", "label": 1}\n{"text": null, "label": 0}\n'},
     CLS, "cls/train.jsonl:2: the text is None, not a text"),
    ("eval.py seeds that are not integers", {}, CLS + ["--seeds", "42,x"], "seeds integers like 42,43,44"),
    ("eval.py 0 epochs", {},
     CLS + ["--epochs", "0"], "--epochs=0: epochs, batch_size, max_tokens and lr must be positive"),
    ("eval.py --max_len beyond the model's positions", {},
     CLS + ["--max_len", "9000"], "--max_len: max_len=9000 is beyond the model's 8192 positions; give at most 8192"),
    ("train.py a config file that does not exist", {},
     TRAIN + ["configs/nope.py", "--out_dir=other"], "config file 'configs/nope.py' not found"),
    ("train.py no data_dir", {}, NEW_RUN + ["--data_dir="], "data_dir is not set: point it"),
    ("train.py a data_dir that data.py never made", {},
     NEW_RUN + ["--data_dir=nowhere"], "nowhere: no meta.json; make the shards first with `python data.py"),
    ("train.py an objective with a typo", {},
     NEW_RUN + ["--objective=mlmm"], "objective='mlmm': choose 'clm' or 'mlm'"),
    ("train.py a value of the wrong type", {}, NEW_RUN + ["--lr=abc"], "--lr=abc: lr must be float, got 'abc'"),
    ("train.py an attention backend that is none", {},
     NEW_RUN + ["--attn_backend=flex"], "unknown attention backend 'flex'; choose one of auto, flash, varlen, cudnn"),
]


@pytest.mark.parametrize("name,files,command,message", ROWS, ids=[r[0] for r in ROWS])
def test_mistake(workdir, tmp_path, capsys, name, files, command, message):
    d = tmp_path / "work"
    shutil.copytree(workdir, d, symlinks=True)
    for path, content in files.items():
        if isinstance(content, str) and content.startswith("@"):  # a copy of a file or folder
            (shutil.copytree if (d / content[1:]).is_dir() else shutil.copyfile)(d / content[1:], d / path)
        else:
            (d / path).parent.mkdir(parents=True, exist_ok=True)
            (d / path).write_bytes(content if isinstance(content, bytes) else content.encode())
    before = sums(d)
    with pytest.raises(SystemExit) as stop:  # any other exception is a traceback for a user's mistake
        main(d, command)
    said = f"{stop.value.code}\n{capsys.readouterr().err}"  # the message, or argparse's usage line
    assert stop.value.code not in (0, None), f"{name}: exit 0"
    assert message in said, f"{name}: {said[-1500:]}"
    assert sums(d) == before, f"{name}: the command changed what was on disk"


def test_rerun_replaces_a_data_set_whole_and_counts_the_empty_texts_it_skipped(workdir, tmp_path, capsys):
    """A successful re-run with another tokenizer leaves the new tokenizer beside the new shards, nothing of the old
    run (a tokenizer companion file the new one lacks included), and no staging folder, the one a killed run left
    included. Empty and null texts are skipped and counted."""
    d = tmp_path / "work"
    shutil.copytree(workdir, d, symlinks=True)
    (d / "shards" / "special_tokens_map.json").write_text("{}")  # as if the old tokenizer had one
    (d / "shards.prepare.tmp").mkdir()  # and what a killed run left staged: a companion of its tokenizer
    (d / "shards.prepare.tmp" / "tokenizer_config.json").write_text("{}")
    lines = [{"text": t} for t in TEXTS[:40]] + [{"text": ""}, {"text": None}, {"text": "   "}]
    (d / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    main(d, DATA + ["--input", "in.jsonl", "--tokenizer", "other_tok.json", "--out", "shards", "--val_docs", "10"])
    assert "skipped 2 empty or null texts of 43" in capsys.readouterr().out
    assert sorted(os.listdir(d / "shards")) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    assert not (d / "shards.prepare.tmp").exists()
    assert (d / "shards" / "tokenizer.json").read_bytes() == (d / "other_tok.json").read_bytes()
    meta = json.loads((d / "shards" / "meta.json").read_text())
    assert meta["tokenizer_sha256"] == hashlib.sha256((d / "other_tok.json").read_bytes()).hexdigest()
    assert meta["train_docs"] + meta["val_docs"] == 41  # "   " is a text (of spaces), kept as written


def test_resume_accepts_run_settings_and_named_changes(workdir, tmp_path):
    """What does not change the run (an interval, the device) may change on resume; so may a key named in
    resume_changes. A finished run resumed this way ends again at once."""
    d = tmp_path / "work"
    shutil.copytree(workdir, d, symlinks=True)
    for extra in (["--log_interval=2", "--eval_interval=3"], ["--seed=3", "--resume_changes=seed"]):
        main(d, TRAIN + TINY_RUN + ["--out_dir=run", *extra])
    assert json.loads((d / "run" / "config.json").read_text())["seed"] == 3  # what it now runs with


def test_torchrun_says_a_mistake_once(workdir):
    """Every process checks the config; rank 0 alone prints what is wrong (torchrun adds its own report)."""
    before = sums(workdir)
    r = subprocess.run([*launcher(2), os.path.join(ROOT, "train.py"), *TINY_RUN, "--out_dir=new_run", "--lr_typo=1"],
                       cwd=workdir, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert (r.stdout + r.stderr).count("--lr_typo=1: unknown config key 'lr_typo'. Valid keys: out_dir") == 1, \
        r.stderr[-3000:]
    assert sums(workdir) == before


# ---------------------------------------------------------------------------------------------------------------------
# What a run can know at step 0 stops it at start-up, in one line naming the fix.


STEPS = 20


def check_run(c, steps, world):
    """train.start's checks of what a run names: its data, then out_dir and init_from -> the data's meta.json."""
    meta = shards.check_data(c.data_dir, c.seq_len, c.micro_batch_size, world, steps * c.global_batch_size)
    checkpoint.check_start(c, meta, 0)
    return meta


def config(data_dir, tmp_path, **kw):
    return Config(**{"data_dir": data_dir, "out_dir": str(tmp_path / "out"), "seq_len": 64, "global_batch_size": 8,
                     "micro_batch_size": 4, **kw})


@pytest.mark.parametrize("split, fix", [("val", "larger --val_docs"), ("train", "use more data")])
def test_a_split_smaller_than_one_micro_batch_on_every_rank(data_dir, tmp_path, split, fix):
    short = tmp_path / "short"
    shutil.copytree(data_dir, short)
    os.truncate(short / f"{split}.bin", 2 * 64 * 5)  # 5 windows of 64 uint16 tokens
    meta = json.loads((short / "meta.json").read_text())
    (short / "meta.json").write_text(json.dumps({**meta, f"{split}_tokens": 64 * 5}))  # as data.py would count them
    with pytest.raises(SystemExit, match=f"{split}.bin makes 5 windows of seq_len=64, fewer than .*micro_batch_size=4 "
                                         f"x world size 2 = 8.*{fix}"):
        check_run(config(str(short), tmp_path), STEPS, 2)
    check_run(config(str(short), tmp_path, micro_batch_size=2), STEPS, 2)  # 2 x 2 windows: fine


def test_a_run_that_can_start_passes_and_a_note_says_when_data_repeats(data_dir, base_ckpt, tmp_path, capsys):
    meta = check_run(config(data_dir, tmp_path, init_from=base_ckpt), STEPS, 2)
    assert meta["vocab_size"] > 0 and not (tmp_path / "out").exists()  # the run makes it, not its checks
    assert capsys.readouterr().err == ""  # 20 steps x 8 windows: less than one epoch, no note
    windows = os.path.getsize(os.path.join(data_dir, "train.bin")) // 2 // 64
    check_run(config(data_dir, tmp_path), windows // 8 * 3, 1)  # three times the data
    note = capsys.readouterr().err
    assert f"the schedule reads {windows // 8 * 3 * 8:,} windows" in note and f"holds {windows:,}" in note
    assert "the data repeats (3.0 epochs)" in note


def test_out_dir_and_init_from_problems_are_one_line(data_dir, base_ckpt, tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match=r"out_dir=.*a_file/out: .*a_file is a file, not a directory"):
        check_run(config(data_dir, tmp_path, out_dir=str(tmp_path / "a_file" / "out")), STEPS, 1)
    with pytest.raises(SystemExit, match="init_from='.*nowhere' is neither 'scratch' nor a checkpoint directory"):
        check_run(config(data_dir, tmp_path, init_from=str(tmp_path / "nowhere")), STEPS, 1)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(base_ckpt, no_weights)
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(SystemExit, match="init_from=.*no_weights: no model.safetensors"):
        check_run(config(data_dir, tmp_path, init_from=str(no_weights)), STEPS, 1)
    (tmp_path / "out" / "ckpt-8").mkdir(parents=True)  # resuming from out_dir: init_from is not read
    check_run(config(data_dir, tmp_path, init_from=str(no_weights)), STEPS, 1)
