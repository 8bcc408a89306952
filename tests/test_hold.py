"""The hold on an output directory (support/lock.py), with lock files and records that its own code did not write,
and the check that a resumed run is the same run, made under the hold: a changed run that waited for a stopping
holder is refused once it holds out_dir, with everything there as the holder left it."""

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from support import lock
from test_links import sums
from test_train import ROOT, data_dir, train_cmd  # noqa: F401 (data_dir is a fixture)
from test_trust import ENV, hold_in_another_process, let_go, wait_for

RECORD = dict(host="node1", pid=4242, command="python train.py", since="2026-01-01 00:00:00 UTC", state="running",
              beat=1.7e9)


OTHER_SHAPES = {"empty": "", "spaces": "   ", "array": "[]", "null": "null", "string": '"node1"', "cut": "{",
                "pid string": json.dumps({**RECORD, "pid": "4242"}), "pid bool": json.dumps({**RECORD, "pid": True}),
                "beat string": json.dumps({**RECORD, "beat": "1.7e9"}),
                "beat nan": json.dumps({**RECORD, "beat": float("nan")}),
                "other state": json.dumps({**RECORD, "state": "done"}),
                "host null": json.dumps({**RECORD, "host": None}),
                "no command": json.dumps({k: v for k, v in RECORD.items() if k != "command"}),
                "longer than a record": json.dumps(RECORD) + " " * lock.RECORD}


@pytest.mark.parametrize("text", OTHER_SHAPES.values(), ids=OTHER_SHAPES)
def test_a_record_of_another_shape_names_no_holder(tmp_path, text):
    (tmp_path / ".lock").write_text(text)
    assert lock.holder(str(tmp_path / ".lock")) == {}


def test_a_record_names_its_holder(tmp_path):
    for beat in (1.7e9, 1700000000):
        (tmp_path / ".lock").write_text(json.dumps({**RECORD, "beat": beat}).ljust(lock.RECORD))
        assert lock.holder(str(tmp_path / ".lock")) == {**RECORD, "beat": beat}


def test_a_held_lock_whose_record_names_no_holder_is_refused_in_one_line(tmp_path, monkeypatch):
    """Another process holds the lock, and its record is of another shape: refused after UNNAMED seconds, not a
    KeyError, not a wait for ever."""
    monkeypatch.setattr(lock, "UNNAMED", 0.5)
    holder = hold_in_another_process(tmp_path)
    path = tmp_path / ".lock"
    try:
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, json.dumps({"pid": "x", "beat": "soon"}).ljust(lock.RECORD).encode(), 0)
        os.close(fd)
        t0 = time.time()
        with pytest.raises(SystemExit) as e:
            lock.take(str(tmp_path), "out_dir")
        assert str(e.value).startswith(f"out_dir={tmp_path} is held by a process that {path} does not name. If that "
                                       f"process is gone")
        assert time.time() - t0 < 60  # UNNAMED, not WAIT (10 minutes)
    finally:
        let_go(holder)


def test_a_longer_lock_file_is_cut_to_its_record_once_held(tmp_path):
    """A lock file with more than a record (the record of a free lock is rewritten in place): after the take, the
    record alone, which names this process."""
    (tmp_path / ".lock").write_text("x" * 100_000)
    lock.take(str(tmp_path), "out_dir")
    assert os.path.getsize(tmp_path / ".lock") == lock.RECORD
    assert lock.holder(str(tmp_path / ".lock"))["pid"] == os.getpid()


def test_a_changed_run_that_waited_for_a_stopping_holder_is_refused_under_the_hold(data_dir, tmp_path):
    """The issue's case. Run A holds out_dir and is writing its first checkpoint after a SIGTERM (its lock says
    "stopping"); run B, with another objective, lr and seed, starts meanwhile: nothing to resume yet, so its start-up
    checks pass and it waits. Once A has written ckpt-16 and let go, B holds out_dir and is refused in one line; it
    never resumes A's checkpoint as its own or rewrites config.json, and leaves out_dir (the lock file included) as A
    left it."""
    out, aside = tmp_path / "run", tmp_path / "aside"
    r = subprocess.run(train_cmd(out, data_dir, "--run_phases=main", "--ckpt_interval=16"), cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    aside.mkdir()
    for name in ("ckpt-16", "final"):  # A, before its last checkpoint
        shutil.move(out / name, aside / name)
    holder = hold_in_another_process(out, "stopping")
    log = tmp_path / "b.log"
    b = subprocess.Popen(train_cmd(out, data_dir, "--run_phases=main", "--objective=mlm", "--lr=1e-3", "--seed=3"),
                         cwd=ROOT, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: re.search(f"out_dir={out} is held by pid {holder.pid} .*stopping", open(log).read()), b, log)
        for name in ("ckpt-16", "final"):  # A's checkpoint, written; then A lets go
            shutil.move(aside / name, out / name)
        before = sums(out)
    finally:
        let_go(holder)
    assert b.wait(timeout=300) == 1, open(log).read()[-3000:]
    said = open(log).read()
    assert said.strip().splitlines()[-1] == (
        f"{out} holds a run with other settings: objective 'clm' -> 'mlm'; lr 0.003 -> 0.001; seed 17 -> 3. Resuming "
        "would change what the run is: choose a new out_dir, or, if the change is deliberate, "
        "--resume_changes=objective,lr,seed"), said
    assert "Traceback" not in said and "resuming at step" not in said
    assert sums(out) == before
