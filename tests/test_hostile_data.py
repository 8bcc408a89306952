"""A data directory from elsewhere, broken or hostile: each is refused in one line that names the file and the
field, before any work (nothing allocated, nothing written), or, for an id past the vocabulary inside a shard,
at the step that would read it, with no checkpoint directory left half-written. The data directories are made
by data.py here, then edited as a user (or another user of a shared filesystem) would."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train
from data import prepare, read_documents
from support.tokenizer import train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = [f"document {i} is about {'cells ' * (i % 5)}and {'proteins ' * (i % 3)}in the liver" for i in range(120)]
TINY = ["--model_config={'hidden_size': 32, 'intermediate_size': 48, 'num_hidden_layers': 2, "
        "'num_attention_heads': 2, 'local_attention': 16}", "--seq_len=32", "--global_batch_size=4",
        "--micro_batch_size=2", "--tokens=768", "--warmup_tokens=0", "--decay_frac=0", "--eval_interval=100",
        "--ckpt_interval=2", "--device=cpu", "--compile=False"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A data directory as data.py makes it: a 300-token BPE, uint16 shards, meta.json."""
    d = tmp_path_factory.mktemp("hostile_data")
    (d / "corpus.txt").write_text("\n".join(TEXTS) + "\n")
    train_bpe(iter(TEXTS), 300, str(d / "tok.json"))
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
    message = refusal([f"--data_dir={d}", f"--out_dir={tmp_path / 'out'}", *TINY])
    assert said in message and "data.py" in message, message  # the file, the field, the fix
    assert not (tmp_path / "out").exists() and snapshot(d) == before


def test_a_meta_json_that_is_a_fifo_is_refused_not_waited_on(shards, tmp_path):
    d = copy(shards, tmp_path)
    os.remove(d / "meta.json")
    os.mkfifo(d / "meta.json")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TINY],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "meta.json is a FIFO, not a file" in r.stderr and "Traceback" not in r.stderr


def test_a_dtype_that_would_crash_the_process_is_one_line(shards, tmp_path):
    """dtype "object" over a train.bin of whole 8-byte items: numpy would map raw bytes as Python objects."""
    d = copy(shards, tmp_path, lambda m: {**m, "dtype": "object"})
    os.truncate(d / "train.bin", os.path.getsize(d / "train.bin") // 8 * 8)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TINY],
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
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--data_dir={d}", "--out_dir=out", *TINY,
                        "--data_seed=0"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"{d / 'train.bin'}: holds token id {bad_id} (near token {window * 32:,}), past the vocabulary of its "
        "meta.json (vocab_size=300): the file is not what data.py wrote; prepare the data again (the checkpoints "
        "written so far are intact)")
    assert [n for n in sorted(os.listdir(tmp_path / "out")) if "ckpt" in n] == ["ckpt-2"]
