"""What is shared can be trusted: a checkpoint whose train_state.pt would run code is refused or ignored by every
script, and one run writes an out_dir at a time (support/lock.py): a second is refused at once, a stopping or silent
holder is waited for. (A killed holder leaves nothing to clean up: test_resilience and test_suite resume such runs.)"""

import errno
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import cka
import eval as eval_script
from support import lock
from support.checkpoint import MANIFEST, TRAIN_STATE
from support.files import sha256
from test_files import runs_code
from test_links import sums
from test_train import ROOT, data_dir, metrics, run_train, train_cmd, train_here  # noqa: F401 (data_dir is a fixture)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def analyses(ckpt, tmp_path, out):
    """cka.py's and eval.py's main() on the checkpoint `ckpt`, with tiny inputs, writing to `out`: -> the two calls."""
    texts, task = tmp_path / "texts.jsonl", tmp_path / "task"
    texts.write_text("".join(json.dumps({"text": f"the gene binds a cell number {i}."}) + "\n" for i in range(8)))
    task.mkdir(exist_ok=True)
    for split in ("train", "validation", "test"):
        (task / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"the {w} binds", "label": w}) + "\n"
                                                     for w in ("cell", "gene") * 4))
    common = ["--out", str(out), "--device", "cpu", "--seeds", "1"]
    return [lambda: cka.main(["--pair", ckpt, ckpt, "--texts", str(texts), "--n", "8", *common]),
            lambda: eval_script.main(["--model", ckpt, "--task", "cls", "--data", str(task), "--epochs", "1", *common])]


def refusal(out, data_dir, *args):
    """train.py's main() here (test_train.train_here), on the tiny run: -> the one line it stops with, and what it
    printed before."""
    r = train_here(out, data_dir, *args, check=False)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1], r.stdout


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    """A run of 16 steps with one checkpoint to resume, ckpt-16 (and final), and 16 records in metrics.jsonl; each
    test copies it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train_here(out, data_dir, "--run_phases=main", "--ckpt_interval=16")
    return out


def forge(ckpt, state):
    """`state` as ckpt's train_state.pt, the manifest updated to match, as a forger would."""
    torch.save(state, ckpt / TRAIN_STATE)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest[TRAIN_STATE] = {"bytes": os.path.getsize(ckpt / TRAIN_STATE), "sha256": sha256(ckpt / TRAIN_STATE)}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_a_train_state_that_would_run_code_or_another_code_wrote_is_refused_or_ignored(finished, data_dir, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "it_ran"
    shutil.copytree(finished, out)
    ckpt = out / "ckpt-16"
    state = torch.load(ckpt / TRAIN_STATE, weights_only=True)  # what train.py writes loads as plain data
    forge(ckpt, {**state, "extra": runs_code(marker)})  # a callable in train_state.pt
    torch.load(ckpt / TRAIN_STATE, weights_only=False)  # the plant works: unpickling runs it
    assert marker.is_dir()
    marker.rmdir()

    # Resuming from it (out_dir's newest checkpoint; a decay run from it as init_from loads it the same way): refused
    line, _ = refusal(out, data_dir)
    assert line.startswith(f"{ckpt / TRAIN_STATE}: refused: it holds objects other than tensors"), line
    # Weights from it (a new run), its CKA and its fine-tuning never read the train state.
    train_here(tmp_path / "new", data_dir, f"--init_from={ckpt}", "--run_phases=main", f"--tokens={2 * 8 * 64}")
    for analysis in analyses(str(ckpt), tmp_path, tmp_path / "out"):
        analysis()
    assert not marker.exists()

    # cka.py --out and eval.py --out held by another run: refused in one line, before any model runs.
    holder = Holder(tmp_path / "held")
    for analysis in analyses(str(ckpt), tmp_path, tmp_path / "held"):
        with pytest.raises(SystemExit, match=f"^--out={tmp_path / 'held'} is in use by pid {holder.pid} "):
            analysis()
    holder.let_go()

    # A train state, vouched for by its manifest, that this code did not write: refused in one line, no traceback,
    # nothing changed but the lock's record.
    forge(ckpt, {**state, "ranks": [{}]})  # no random streams for rank 0
    before = sums(out)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 16
    assert refusal(out, data_dir)[0] == (
        f"{ckpt / TRAIN_STATE}: not a train state this code wrote (KeyError: 'rng'). Restore the checkpoint from a "
        "copy, or move it away to resume from the one before")
    after = sums(out)
    assert after.pop(".lock") != before.pop(".lock")  # the refusal came under the hold: its record, only
    assert after == before


# -----------------------------------------------------------------------------
# One run per out_dir


def start(out, data_dir, log, *args, said=None):
    """train.py in the background, its output in `log`, once it has `said` (a pattern) or else holds out_dir (its lock
    file names it)."""
    proc = subprocess.Popen(train_cmd(out, data_dir, *args), cwd=ROOT, env=ENV, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    wait_for(lambda: re.search(said, open(log).read()) if said else
             (out / ".lock").is_file() and (out / ".lock").read_text().strip(), proc, log)
    return proc


def wait_for(condition, proc, log, seconds=120):
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
        time.sleep(0.05)


LONG = [f"--tokens={100 * 8 * 64}", "--ckpt_interval=20", "--eval_interval=100"]  # 125 steps: seconds


def test_a_second_run_on_one_out_dir_is_refused_and_a_signalled_holder_says_it_is_stopping(data_dir, tmp_path):
    """A second run is refused at once; from the holder's SIGTERM on, its lock says "stopping" (a requeued job waits
    for it) while it writes its checkpoint and exits 143 as before."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = start(out, data_dir, log, *LONG)
    first.send_signal(signal.SIGSTOP)  # paused, not finished, while the same command starts again
    try:
        line, printed = refusal(out, data_dir, *LONG)
        job = run_train(out, data_dir, *LONG, check=False, nproc=2)  # under torchrun: said once, by rank 0
    finally:  # never left stopped: it finishes its few seconds of steps whatever happened here
        first.send_signal(signal.SIGCONT)
    assert line.startswith(f"out_dir={out} is in use by pid {first.pid} on "), line
    assert "choose another out_dir" in line and "step" not in printed  # refused before any work
    said = [line for line in job.stderr.splitlines() if "is in use by" in line]
    assert job.returncode != 0 and len(said) == 1 and said[0].startswith(f"out_dir={out} is in use by pid {first.pid}")

    wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size, first, log)
    first.send_signal(signal.SIGTERM)
    deadline = time.time() + 60
    while lock.holder(str(out / ".lock")).get("state") != "stopping":
        assert time.time() < deadline
        time.sleep(0.01)
    assert first.wait() == 143
    steps = [m["step"] for m in metrics(out)]
    assert steps == sorted(set(steps)) and "stopped by SIGTERM at step" in open(log).read()  # each step logged once


class Holder(lock.Hold):
    """`out` held as another run would hold it, on a descriptor of its own (which flock tells from any other, in
    this process too), until let_go(): its record says `state`, its heartbeat `beat_age` seconds old by its clock
    (one `beat` seconds apart)."""

    def __init__(self, out, state="running", beat_age=0.0, beat=3600):
        self.state, self.age, self.period, self.pid, self.gone = state, beat_age, beat, os.getpid(), threading.Event()
        os.makedirs(out, exist_ok=True)
        fd = os.open(os.path.join(out, lock.LOCK), os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        super().__init__(fd)

    def write(self):
        with self.writing:
            if not self.gone.is_set():
                record = {**self.info, "state": self.state, "beat": time.time() - self.age}
                os.pwrite(self.fd, json.dumps(record).ljust(lock.RECORD).encode(), 0)

    def beat(self):
        while not self.gone.wait(self.period):
            self.write()

    def let_go(self):
        with self.writing:
            self.gone.set()
            os.close(self.fd)  # and the lock with it


def test_a_requeued_run_waits_for_a_silent_holder(finished, data_dir, tmp_path):
    """A lost node whose lock the filesystem has not dropped yet: waited for; once it lets go, the run resumes. (A
    holder writing its last checkpoint after SIGTERM is waited for alike: test_a_changed_run_that_waited_...)"""
    out, log = tmp_path / "run", tmp_path / "requeued.log"
    shutil.copytree(finished, out)
    holder = Holder(out, "running", 1000)
    why = r"its heartbeat 10\d\d s old by its clock \(lost, or its clock is not ours\); waiting up to 10 minutes for it"
    run = start(out, data_dir, log, said=f"out_dir={out} is held by pid {holder.pid} on .*, {why}")
    holder.let_go()
    assert run.wait() == 0, open(log).read()[-3000:]
    said = open(log).read()
    assert "its holder is gone after" in said and "resuming at step 16" in said


def test_a_silent_holder_is_told_from_one_whose_clock_differs(tmp_path, monkeypatch):
    """An old heartbeat by the holder's clock that moves: a live holder, refused at once; one that stays put for
    STALE seconds on ours: a lost one, waited for, then refused with what to do."""
    monkeypatch.setattr(lock, "STALE", 3.0)
    monkeypatch.setattr(lock, "WAIT", 600.0)  # the moving heartbeat is seen long before, however busy the machine
    holder = Holder(tmp_path / "skewed", beat_age=1000, beat=1)
    with pytest.raises(SystemExit, match=f"is in use by pid {holder.pid}"):
        lock.take(str(tmp_path / "skewed"), "out_dir")
    holder.let_go()
    monkeypatch.setattr(lock, "WAIT", 6.0)
    holder = Holder(tmp_path / "lost", beat_age=1000)
    with pytest.raises(SystemExit, match=r"is still held by .* after 0 minutes\. If that process is gone .* remove "):
        lock.take(str(tmp_path / "lost"), "out_dir")
    holder.let_go()


def test_a_filesystem_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Lustre without -o flock refuses flock (ENOSYS): a warning names the fix, and nothing is held."""
    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(lock.fcntl, "flock", no_locks)
    assert lock.take(str(tmp_path / "out"), "out_dir") is None
    assert "its filesystem has no file locks (Function not implemented)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Lock files and records that lock.py did not write, and the check, under the hold, that a resumed run is the same.


RECORD = dict(host="node1", pid=4242, command="python train.py", since="2026-01-01 00:00:00 UTC", state="running",
              beat=1.7e9)
OTHER_SHAPES = ["", "   ", "[]", "null", '"node1"', "{", json.dumps({**RECORD, "pid": "4242"}),
                json.dumps({**RECORD, "pid": True}), json.dumps({**RECORD, "beat": "1.7e9"}),
                json.dumps({**RECORD, "beat": float("nan")}), json.dumps({**RECORD, "state": "done"}),
                json.dumps({**RECORD, "host": None}), json.dumps({k: v for k, v in RECORD.items() if k != "command"}),
                json.dumps(RECORD) + " " * lock.RECORD]  # longer than a record


def test_a_record_names_its_holder_only_in_its_own_shape_and_a_take_cuts_a_longer_file_to_it(tmp_path):
    for beat in (1.7e9, 1700000000):
        (tmp_path / ".lock").write_text(json.dumps({**RECORD, "beat": beat}).ljust(lock.RECORD))
        assert lock.holder(str(tmp_path / ".lock")) == {**RECORD, "beat": beat}
    for text in OTHER_SHAPES:
        (tmp_path / ".lock").write_text(text)
        assert lock.holder(str(tmp_path / ".lock")) == {}, text
    (tmp_path / ".lock").write_text("x" * 100_000)  # a free lock's record is rewritten in place
    lock.take(str(tmp_path), "out_dir")
    assert os.path.getsize(tmp_path / ".lock") == lock.RECORD
    assert lock.holder(str(tmp_path / ".lock"))["pid"] == os.getpid()


STOPPED_IN_ITS_TAKE = """import os, signal, sys, time
sys.path.insert(0, {root!r})
from support import lock
sync = os.fsync
def stop_once(fd):  # the first sync of the take, as a loaded machine or NFS may hold a process there
    os.fsync = sync
    os.kill(os.getpid(), signal.SIGSTOP)
    sync(fd)
os.fsync = stop_once
lock.take(sys.argv[1], "out_dir")
time.sleep(300)
"""


def test_a_holder_stopped_in_its_take_is_named_in_a_lock_file_that_was_longer(tmp_path):
    """A take cuts a longer lock file (another version's, a hand-made one) to a record's size before it writes its
    record: a holder stopped right after that write, in its sync, is named, and a second run is refused at once."""
    (tmp_path / ".lock").write_text(json.dumps(RECORD) + " " * 100_000)
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_IN_ITS_TAKE.format(root=ROOT), str(tmp_path)])
    try:
        deadline = time.time() + 120
        while not os.WIFSTOPPED(os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)[1]):
            assert proc.poll() is None and time.time() < deadline, "the holder did not stop in its take"
            time.sleep(0.05)
        assert lock.holder(str(tmp_path / ".lock"))["pid"] == proc.pid
        with pytest.raises(SystemExit, match=f"^out_dir={tmp_path} is in use by pid {proc.pid} "):
            lock.take(str(tmp_path), "out_dir")
    finally:
        proc.kill()
        proc.wait()


def test_a_held_lock_whose_record_names_no_holder_is_refused_in_one_line(tmp_path, monkeypatch):
    """Refused after UNNAMED seconds: not a KeyError, not a wait for ever."""
    monkeypatch.setattr(lock, "UNNAMED", 0.5)
    holder = Holder(tmp_path)
    path = tmp_path / ".lock"
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, json.dumps({"pid": "x", "beat": "soon"}).ljust(lock.RECORD).encode(), 0)
    os.close(fd)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        lock.take(str(tmp_path), "out_dir")
    assert str(e.value).startswith(f"out_dir={tmp_path} is held by a process that {path} does not name. If that "
                                   "process is gone")
    assert time.time() - t0 < 60  # UNNAMED, not WAIT (10 minutes)
    holder.let_go()


def test_a_changed_run_that_waited_for_a_stopping_holder_is_refused_under_the_hold(finished, data_dir, tmp_path):
    """Run A holds out_dir, writing its first checkpoint after a SIGTERM; run B, with another objective, lr and seed,
    starts meanwhile: nothing to resume yet, so its start-up checks pass and it waits. Once A has written ckpt-16 and
    let go, B holds out_dir and is refused in one line, leaving out_dir (the lock file included) as A left it."""
    out, aside = tmp_path / "run", tmp_path / "aside"
    shutil.copytree(finished, out)
    aside.mkdir()
    for name in ("ckpt-16", "final"):  # A, before its last checkpoint
        shutil.move(out / name, aside / name)
    holder, log = Holder(out, "stopping"), tmp_path / "b.log"
    try:
        b = start(out, data_dir, log, "--run_phases=main", "--objective=mlm", "--lr=1e-3", "--seed=3",
                  said=f"out_dir={out} is held by pid {holder.pid} .*stopping")
        for name in ("ckpt-16", "final"):  # A's checkpoint, written; then A lets go
            shutil.move(aside / name, out / name)
        before = sums(out)
    finally:
        holder.let_go()
    assert b.wait(timeout=300) == 1, open(log).read()[-3000:]
    said = open(log).read()
    assert said.strip().splitlines()[-1] == (
        f"{out} holds a run with other settings: objective 'clm' -> 'mlm'; lr 0.003 -> 0.001; seed 17 -> 3. Resuming "
        "would change what the run is: choose a new out_dir, or, if the change is deliberate, "
        "--resume_changes=objective,lr,seed"), said
    assert "Traceback" not in said and "resuming at step" not in said
    assert sums(out) == before
