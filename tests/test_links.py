"""Nothing is written, renamed or deleted through a link the project did not make (support/files.py): a link planted
where an output goes is refused in one line naming it, and what it points to keeps its checksums. Nothing from
outside the data directory is copied into a checkpoint."""

import hashlib
import os
import shutil
import threading

import pytest
import torch

import cka
import data
import train
from model import ModernBertConfig, ModernBertForMaskedLM
from support import files, lock, suite
from support.checkpoint import prune, save_checkpoint
from support.metrics import trim_metrics
from support.shards import tokenizer_files
from test_train import TINY, data_dir, train_cmd  # noqa: F401 (data_dir is a fixture)
from train import Config, make_optimizer


def sums(folder):
    """Every entry under `folder`, links not followed: a file's sha256, a link's target, "dir" for a folder."""
    paths = [os.path.join(root, name) for root, dirs, names in os.walk(folder) for name in dirs + names]
    return {os.path.relpath(p, folder): "-> " + os.readlink(p) if os.path.islink(p) else "dir" if os.path.isdir(p)
            else hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def within(seconds, fn):
    """fn() in a thread: a call that blocks fails after `seconds`, not hangs -> {"value": ...} or {"error": ...}"""
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


@pytest.fixture
def elsewhere(tmp_path):
    """Files outside any run: what a planted link points to."""
    root = tmp_path / "elsewhere"
    (root / "folder").mkdir(parents=True)
    (root / "secret.txt").write_text("a file this user may write, outside every run\n")
    (root / "folder" / "notes.txt").write_text("a folder's file\n")
    return root


def refuses(fn, path, target):
    """fn() stops with the one line a link at `path` to `target` gets."""
    with pytest.raises(SystemExit) as e:
        fn()
    assert str(e.value) == (f"{path} is a symbolic link to {target}, not a file this project made: nothing is written, "
                            f"renamed or deleted there. Remove it and re-run (if you did not put it there, someone who "
                            f"can write to {os.path.dirname(path)} did)")


WRITERS = {  # each of support/files.py's ways to write, rename or delete, on a path inside an output directory
    "open_file w": lambda p: files.open_file(p, "w").write("x"),
    "open_file a": lambda p: files.open_file(p, "a").write("x"),
    "replace_file": lambda p: files.replace_file(p, "x"),
    "remove": files.remove,
    "fresh_dir": files.fresh_dir,
    "make_dirs": lambda p: files.make_dirs(os.path.dirname(p), os.path.join(p, "sub")),
    "the lock": lambda p: lock.take(os.path.dirname(p), "--out"),
}


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("target", ["secret.txt", "folder", "missing.txt"])  # missing: a write would create it
def test_every_writer_refuses_a_link_and_leaves_its_target_as_it_was(tmp_path, elsewhere, writer, target):
    out = tmp_path / "out"
    out.mkdir()
    link = out / (".lock" if writer == "the lock" else "planted")
    os.symlink(elsewhere / target, link)
    before = sums(elsewhere)
    refuses(lambda: WRITERS[writer](str(link)), link, elsewhere / target)
    assert sums(elsewhere) == before and not (elsewhere / "missing.txt").exists()


@pytest.mark.parametrize("entry", ["directory", "fifo", "hard link"])
def test_a_file_is_written_in_place_only_if_it_is_a_file_of_one_name(tmp_path, elsewhere, entry):
    """A directory or a FIFO (no hang) where a file goes, or a hard link to a file elsewhere (appending would change
    it): one line each, the other name's file unchanged."""
    out = tmp_path / "out"
    out.mkdir()
    for name, write in (("metrics.jsonl", WRITERS["open_file a"]), (".lock", WRITERS["the lock"])):
        path = out / name
        if entry == "directory":
            path.mkdir()
        elif entry == "fifo":
            os.mkfifo(path)
        else:
            os.link(elsewhere / "secret.txt", path)
        before = sums(elsewhere)
        names = os.stat(path).st_nlink  # 2, then 3: both are names of secret.txt
        what = {"directory": "a directory", "fifo": "a FIFO", "hard link": f"a hard link (one of the {names} names "
                "of a file)"}[entry]
        e = within(20, lambda: write(str(path))).get("error")  # a FIFO no one writes: a blocking open waits for ever
        assert isinstance(e, SystemExit) and str(e).startswith(f"{path} is {what}, not a file this project made"), e
        assert sums(elsewhere) == before


@pytest.fixture
def tiny(data_dir):
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))
    c = Config(data_dir=data_dir, lr=1e-3)
    optimizer = make_optimizer(model, c, torch.device("cpu"))
    model(torch.randint(0, 320, (1, 16))).sum().backward()
    optimizer.step()  # so that the optimizer has moments to save
    return model, optimizer, c


def test_checkpoints_are_never_written_or_deleted_through_a_link(tiny, tmp_path, elsewhere):
    """The staging folder, the rename over ckpt-N or final, retention's removal and trimming metrics.jsonl."""
    model, optimizer, c = tiny
    out = tmp_path / "out"
    out.mkdir()
    save_checkpoint(str(out / "ckpt-10"), model, optimizer, {"step": 10}, c)
    save_checkpoint(str(elsewhere / "ckpt-20"), model, optimizer, {"step": 20}, c)  # another run's checkpoint
    before = sums(elsewhere)
    for name, target in ((".tmp-ckpt-30", elsewhere / "folder"), ("final", elsewhere / "ckpt-20"),
                         ("ckpt-40", elsewhere / "missing")):
        os.symlink(target, out / name)
        refuses(lambda: save_checkpoint(str(out / name.removeprefix(".tmp-")), model, optimizer, {"step": 30}, c),
                out / name, target)
        os.remove(out / name)
    os.symlink(elsewhere / "ckpt-20", out / "ckpt-5")  # the oldest: prune would remove it, or its train state
    for keep_every in (0, 5):
        refuses(lambda: prune(str(out), 1, keep_every), out / "ckpt-5", elsewhere / "ckpt-20")
    os.symlink(elsewhere / "secret.txt", out / "metrics.jsonl")
    refuses(lambda: trim_metrics(str(out / "metrics.jsonl"), 10), out / "metrics.jsonl", elsewhere / "secret.txt")
    assert sums(elsewhere) == before and not (elsewhere / "missing").exists()
    assert sorted(os.listdir(out)) == ["ckpt-10", "ckpt-5", "metrics.jsonl"]  # no staging folder left


def test_a_checkpoint_copies_only_the_data_dirs_own_tokenizer_files(tiny, tmp_path, elsewhere):
    """tokenizer.json wherever a link leads, once its sha256 is meta.json's; another tokenizer file only when it is
    no link (a link to a private file would put that file into every checkpoint, which travels)."""
    model, optimizer, c = tiny
    shared = tmp_path / "shared"  # a copy of the data dir whose tokenizer.json is a link to an identical file
    shutil.copytree(c.data_dir, shared)
    os.rename(shared / "tokenizer.json", elsewhere / "tokenizer.json")
    os.symlink(elsewhere / "tokenizer.json", shared / "tokenizer.json")
    tok = (elsewhere / "tokenizer.json").read_bytes()
    c.data_dir = str(shared)
    save_checkpoint(str(tmp_path / "ckpt-1"), model, optimizer, {"step": 1}, c)
    copied = tmp_path / "ckpt-1" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == tok

    (elsewhere / "tokenizer.json").write_bytes(tok.replace(b'"[MASK]"', b'"[MASQ]"'))  # the link now leads elsewhere
    with pytest.raises(SystemExit, match=f"{shared / 'tokenizer.json'} is not the tokenizer the shards of {shared}"):
        tokenizer_files(str(shared))
    (elsewhere / "tokenizer.json").write_bytes(tok)
    os.symlink(elsewhere / "secret.txt", shared / "special_tokens_map.json")
    before = sums(elsewhere)
    with pytest.raises(SystemExit) as e:
        save_checkpoint(str(tmp_path / "ckpt-2"), model, optimizer, {"step": 2}, c)
    assert str(e.value).startswith(f"{shared / 'special_tokens_map.json'} is a symbolic link to "
                                   f"{elsewhere / 'secret.txt'}, which would copy that file into every checkpoint")
    assert sums(elsewhere) == before and not (tmp_path / "ckpt-2").exists()


def test_suite_cka_eval_and_data_outputs_refuse_a_planted_link(tmp_path, elsewhere, data_dir):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    os.symlink(elsewhere / "folder", out / "runs" / "ner")  # a task's folder of stored runs
    before = sums(elsewhere)
    path = suite.run_file(str(out), "ner", "a/final", 42)
    refuses(lambda: suite.store_run(path, {"lr": 1}, {"test": {}}, str(out)), out / "runs" / "ner",
            elsewhere / "folder")
    os.symlink(elsewhere / "secret.txt", out / "results.md")
    # cka.py's and eval.py's results, and, before any work, every script's check of its output directory
    for write in (lambda: cka.write(str(out), "results", {}, "| table |", lambda r, p: False),
                  lambda: files.replace_file(str(out / "results.md"), "eval's table"), lambda: files.check_out_dir(str(out))):
        refuses(write, out / "results.md", elsewhere / "secret.txt")
    # data.py's staging folder beside --out, and a file it replaces in --out.
    os.symlink(elsewhere / "folder", tmp_path / "shards.prepare.tmp")
    prepare = lambda: data.prepare(lambda: iter(["the cell binds a gene."] * 50),  # noqa: E731
                                   os.path.join(data_dir, "tokenizer.json"), str(tmp_path / "shards"), val_docs=5)
    refuses(prepare, tmp_path / "shards.prepare.tmp", elsewhere / "folder")
    os.remove(tmp_path / "shards.prepare.tmp")
    (tmp_path / "shards").mkdir()
    os.symlink(elsewhere / "secret.txt", tmp_path / "shards" / "meta.json")
    refuses(prepare, tmp_path / "shards" / "meta.json", elsewhere / "secret.txt")
    assert sums(elsewhere) == before and not (tmp_path / "shards.prepare.tmp").exists()


def test_train_refuses_a_link_in_out_dir_before_any_work(data_dir, tmp_path, elsewhere, capsys):
    """A `final` that a run would replace at its very end: refused at the start (the scan of out_dir that also meets a
    linked .lock), in one line, nothing written."""
    out, target = tmp_path / "run", elsewhere / "folder"
    out.mkdir()
    os.symlink(target, out / "final")
    before = sums(tmp_path)
    refuses(lambda: train.main(train_cmd(out, data_dir)[2:]), out / "final", target)  # [2:]: train.py's arguments
    assert "step" not in capsys.readouterr().out and sums(tmp_path) == before
