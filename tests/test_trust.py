"""What is shared can be trusted: a checkpoint whose train_state.pt would run code is refused or ignored by every
script, and one run writes an out_dir at a time (support/lock.py): a second is refused at once, a killed holder
leaves nothing to clean up, a stopping or silent one is waited for."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from support.checkpoint import MANIFEST, TRAIN_STATE, sha256
from test_train import ROOT, data_dir, metrics, run_train, train_cmd  # noqa: F401 (data_dir is a fixture)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class RunsCode:
    """Unpickling this calls os.mkdir(path): what any callable in a pickle could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def plant(ckpt, marker):
    """Put a callable in ckpt/train_state.pt and update the manifest to match, as a forger would."""
    state = torch.load(ckpt / TRAIN_STATE, weights_only=True)  # what train.py writes loads as plain data
    torch.save({**state, "extra": RunsCode(str(marker))}, ckpt / TRAIN_STATE)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest[TRAIN_STATE] = {"bytes": os.path.getsize(ckpt / TRAIN_STATE), "sha256": sha256(ckpt / TRAIN_STATE)}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def test_a_train_state_that_would_run_code_is_refused_or_ignored(data_dir, tmp_path):
    run_train(tmp_path / "run", data_dir, "--run_phases=main", "--ckpt_interval=4")  # 16 steps: ckpt-4 ... ckpt-16
    marker = tmp_path / "it_ran"
    plant(tmp_path / "run" / "ckpt-16", marker)
    torch.load(tmp_path / "run" / "ckpt-16" / TRAIN_STATE, weights_only=False)  # the plant works: unpickling runs it
    assert marker.is_dir()
    marker.rmdir()

    # Resuming from it (out_dir's newest checkpoint), and the decay from it (--init_from), are refused in one line.
    for out, extra in (("run", []), ("decay", [f"--init_from={tmp_path / 'run' / 'ckpt-16'}", "--run_phases=decay"])):
        r = run_train(tmp_path / out, data_dir, *extra, check=False)
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
            f"{tmp_path / 'run' / 'ckpt-16' / TRAIN_STATE}: refused: it holds objects other than tensors"), r.stderr
    # Weights from it (a new run), its CKA and its fine-tuning never read the train state.
    ckpt = str(tmp_path / "run" / "ckpt-16")
    run_train(tmp_path / "new", data_dir, f"--init_from={ckpt}", "--run_phases=main", f"--tokens={2 * 8 * 64}")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"the gene binds a cell number {i}."}) + "\n" for i in range(8)))
    task = tmp_path / "task"
    task.mkdir()
    for split in ("train", "validation", "test"):
        (task / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"the {w} binds", "label": w}) + "\n"
                                                     for w in ("cell", "gene") * 4))
    for script in (["cka.py", "--pair", ckpt, ckpt, "--texts", str(texts), "--n", "8", "--seeds", "1"],
                   ["eval.py", "--model", ckpt, "--task", "cls", "--data", str(task), "--seeds", "1", "--epochs", "1"]):
        r = subprocess.run([sys.executable, *script, "--out", str(tmp_path / script[0]), "--device", "cpu"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    assert not marker.exists()


# -----------------------------------------------------------------------------
# One run per out_dir


def start(out, data_dir, *args):
    """train.py in the background, once it holds out_dir (its lock file names it)."""
    proc = subprocess.Popen(train_cmd(out, data_dir, *args), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / ".lock").is_file() or not (out / ".lock").read_text():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


LONG = [f"--tokens={400 * 8 * 64}", "--ckpt_interval=20", "--eval_interval=100"]  # 500 steps: tens of seconds


def test_a_second_run_on_one_out_dir_is_refused_and_a_killed_one_resumes(data_dir, tmp_path):
    out = tmp_path / "run"
    first = start(out, data_dir, *LONG)
    t0 = time.time()
    second = run_train(out, data_dir, *LONG, check=False)
    refused_after = time.time() - t0
    assert first.poll() is None, "the first run ended before the second started"
    line = second.stderr.strip().splitlines()[-1]
    assert second.returncode == 1 and line.startswith(f"out_dir={out} is in use by pid {first.pid} on "), line
    assert "choose another out_dir" in line and refused_after < 30
    assert first.wait() == 0  # undisturbed
    steps = [m["step"] for m in metrics(out)]
    assert steps == sorted(set(steps)) and steps[-1] == 500  # each step logged once
    print(f"second run refused in {refused_after:.1f} s: {line[:120]}...")

    # SIGKILL the holder: the kernel drops its lock, and the same command resumes with no manual step.
    killed = tmp_path / "killed"
    proc = start(killed, data_dir, *LONG)
    while not (killed / "ckpt-20").is_dir():
        time.sleep(0.05)
    proc.kill()
    proc.communicate()
    r = run_train(killed, data_dir, *LONG)
    assert "resuming at step" in r.stdout and [m["step"] for m in metrics(killed)] == steps


def hold_in_another_process(out, state, seconds, beat_age=0.0):
    """A process that holds `out` as a train.py run would, says `state`, with a heartbeat `beat_age` seconds old,
    and lets go after `seconds`."""
    code = f"""
import json, os, time
from support import lock
lock.BEAT = 3600  # no heartbeat: the one written below stays
h = lock.take({str(out)!r}, "out_dir")
if {state!r} == "stopping":
    h.stopping()
os.ftruncate(h.fd, 0)
os.pwrite(h.fd, json.dumps({{**h.info, "beat": time.time() - {beat_age}}}).encode(), 0)
print("held", flush=True)
time.sleep({seconds})
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.parametrize("state, beat_age, why", [("stopping", 0, "stopping: it is writing its last checkpoint"),
                                                  ("running", 1000, r"silent for 10\d\d s: its node may be lost")])
def test_a_requeued_run_waits_for_a_stopping_or_silent_holder(data_dir, tmp_path, state, beat_age, why):
    """A holder that is writing its last checkpoint after SIGTERM, or has been silent for minutes (a lost node
    whose lock the filesystem has not dropped yet), is waited for; then the run resumes."""
    out = tmp_path / "run"
    run_train(out, data_dir, "--run_phases=main", "--ckpt_interval=8")
    holder = hold_in_another_process(out, state, 4, beat_age)
    r = run_train(out, data_dir)
    holder.wait()
    assert re.search(f"out_dir={out} is held by pid {holder.pid} on .*, {why}; waiting up to 10 minutes", r.stderr), \
        r.stderr
    assert "its holder is gone after" in r.stdout and "resuming at step 16" in r.stdout


def test_a_signalled_run_says_it_is_stopping(data_dir, tmp_path):
    """train.py's lock file says "stopping" from the SIGTERM on (a requeued job waits for it), and the run writes
    its checkpoint and exits 143 as before."""
    out = tmp_path / "run"
    proc = start(out, data_dir, *LONG)
    while not metrics_exist(out):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 30
    while json.loads((out / ".lock").read_text() or "{}").get("state") != "stopping":
        assert time.time() < deadline
        time.sleep(0.01)
    assert proc.wait() == 143


def metrics_exist(out):
    return (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size > 0


def test_under_torchrun_a_second_job_is_refused_by_rank_0(data_dir, tmp_path):
    out = tmp_path / "run"
    first = start(out, data_dir, *LONG)
    first.send_signal(signal.SIGSTOP)  # paused, not finished, while the job starts
    r = subprocess.run(train_cmd(out, data_dir, *LONG, nproc=2, port=29541), cwd=ROOT, env=ENV, capture_output=True,
                       text=True)
    first.kill()
    first.communicate()
    said = [line for line in r.stderr.splitlines() if "is in use by" in line]
    assert r.returncode != 0 and len(said) == 1 and said[0].startswith(f"out_dir={out} is in use by pid {first.pid}")
