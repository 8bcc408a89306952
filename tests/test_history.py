"""No history is lost without a word: a checkpoint whose manifest.json or train_state.pt cannot be read (valid JSON of
another shape, a file of another code) is skipped for the one before it, or the run is refused in one line; never a
restart at step 0 that cuts metrics.jsonl. A line of metrics.jsonl that holds no record is kept, and skipped by its
readers."""

import json
import os
import shutil
import subprocess

import pytest
import torch

from model import ModernBertConfig, ModernBertForMaskedLM
from support.card import latest_records
from support.checkpoint import MANIFEST, TRAIN_STATE, latest_valid_checkpoint, save_checkpoint, sha256, weights_only
from support.metrics import records, trim_metrics
from test_links import sums
from test_train import ROOT, TINY, data_dir, train_cmd  # noqa: F401 (data_dir is a fixture)
from train import Config, make_optimizer

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def finished(data_dir, tmp_path_factory):
    """A run of 16 steps with one checkpoint to resume, ckpt-16 (and final), and 16 records in metrics.jsonl."""
    out = tmp_path_factory.mktemp("finished") / "run"
    r = subprocess.run(train_cmd(out, data_dir, "--run_phases=main", "--ckpt_interval=16"), cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def resume(finished, data_dir, tmp_path):
    """A copy of the finished run, and the command that resumes it."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out, train_cmd(out, data_dir, "--run_phases=main", "--ckpt_interval=16")


def test_a_manifest_of_another_shape_leaves_the_run_and_its_log_as_they_were(finished, data_dir, tmp_path):
    """The issue's case: the only checkpoint's manifest.json is `[]`. It once counted as weights-only (no train state
    listed), so the run restarted at step 0 and cut metrics.jsonl to its first lines."""
    out, cmd = resume(finished, data_dir, tmp_path)
    (out / "ckpt-16" / MANIFEST).write_text("[]")
    before = sums(out)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 16
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-2].startswith(f"warning: checkpoint {out / 'ckpt-16'} is damaged ({MANIFEST} is unreadable "
                                f"({out / 'ckpt-16' / MANIFEST} ") and "JSON array" in lines[-2]
    assert lines[-1] == (f"no valid checkpoint in {out}: {out / 'ckpt-16'} are damaged (see the warnings). Restore one "
                         "from a copy, or move them away to start over from init_from.")
    after = sums(out)
    assert after.pop(".lock") != before.pop(".lock")  # the refusal came under the hold: its record, only
    assert after == before


def test_a_train_state_of_another_shape_is_refused_in_one_line(finished, data_dir, tmp_path):
    """A train_state.pt that its manifest vouches for but that this code did not write (another code's, a hand-made
    one): one line naming it, metrics.jsonl as it was."""
    out, cmd = resume(finished, data_dir, tmp_path)
    state = out / "ckpt-16" / TRAIN_STATE
    torch.save({**torch.load(state, weights_only=True), "ranks": [{}]}, state)  # no random streams for rank 0
    manifest = json.loads((out / "ckpt-16" / MANIFEST).read_text())
    manifest[TRAIN_STATE] = {"bytes": os.path.getsize(state), "sha256": sha256(state)}
    (out / "ckpt-16" / MANIFEST).write_text(json.dumps(manifest))
    before = sums(out)
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"{state}: not a train state this code wrote (KeyError: 'rng'). Restore the checkpoint from a copy, or move "
        "it away to resume from the one before")
    after = sums(out)
    after.pop(".lock"), before.pop(".lock")
    assert after == before


@pytest.fixture
def two_checkpoints(data_dir, tmp_path):
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, **TINY))
    c = Config(data_dir=data_dir, lr=1e-3)
    optimizer = make_optimizer(model, c, torch.device("cpu"))
    for step in (10, 20):
        save_checkpoint(str(tmp_path / f"ckpt-{step}"), model, optimizer, {"step": step}, c)
    return tmp_path


def test_a_manifest_that_is_no_manifest_is_damaged_and_skipped(two_checkpoints, capsys):
    """Valid JSON of other shapes: the newest checkpoint is damaged (never weights-only) and resume takes the one
    before it. A manifest that lists files outside its directory, with their right sizes and sha256, is damaged too."""
    ckpt = two_checkpoints / "ckpt-20"
    good = json.loads((ckpt / MANIFEST).read_text())
    entry = good["model.safetensors"]
    weights = "its entry 'model.safetensors' is not a file of the directory with its bytes and sha256"
    for manifest, why in [
            ([], "JSON array"),
            (None, "JSON null"),
            ({**good, TRAIN_STATE: None}, f"its entry '{TRAIN_STATE}' is not a file of the directory"),
            ({**good, "model.safetensors": {**entry, "bytes": str(entry["bytes"])}}, weights),
            ({**good, "model.safetensors": {**entry, "bytes": -1}}, weights),
            ({**good, "model.safetensors": {**entry, "sha256": entry["sha256"][:63]}}, weights),
            ({"../ckpt-10/" + name: e for name, e in good.items()}, "its entry '../ckpt-10/")]:
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
        assert not weights_only(str(ckpt))
        capsys.readouterr()
        assert latest_valid_checkpoint(str(two_checkpoints)) == str(two_checkpoints / "ckpt-10")
        said = capsys.readouterr().err
        assert f"warning: checkpoint {ckpt} is damaged ({MANIFEST} is unreadable ({ckpt / MANIFEST}" in said, said
        assert why in said, said
    (ckpt / MANIFEST).write_text(json.dumps(good))
    assert latest_valid_checkpoint(str(two_checkpoints)) == str(ckpt)


def test_metrics_lines_that_hold_no_record_are_kept_and_skipped(tmp_path, capsys):
    """A resume cuts the records past its step and a line a kill cut short; any other line stays where it is, with a
    warning, and the card's reader passes over it."""
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 4, "loss": 2.0}', "[4, 2.0]", '{"step": "6"}', "not json", b"\xff\xfe".decode("latin-1"),
             '{"step": 7.0}', '{"step": true}', '{"loss": 1.0}', '{"step": 8, "loss": "n/a"}',
             '{"step": 8, "loss": 1.5}', '{"step": 12, "loss": 1.0}']
    path.write_bytes("\n".join(lines).encode("latin-1") + b'\n{"step": 16, "lo')
    trim_metrics(str(path), 8)
    assert path.read_bytes() == "\n".join(lines[:-1]).encode("latin-1") + b"\n"
    assert capsys.readouterr().err == (f"warning: {path}: line(s) 2, 3, 4, 5, 6, 7, 8 hold no record (a JSON object "
                                       "with an integer step): kept as they are; readers skip them\n")
    assert records(str(path)) == [{"step": 4, "loss": 2.0}, {"step": 8, "loss": "n/a"}, {"step": 8, "loss": 1.5}]
    last, val = latest_records(str(tmp_path), 8)
    assert last == {"step": 8, "loss": 1.5} and val is None


def test_a_metrics_file_that_is_no_file_is_refused_without_a_hang(tmp_path):
    """A FIFO where metrics.jsonl goes (a blocking read would wait for ever) or a directory: one line."""
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(SystemExit, match="metrics.jsonl is a FIFO.*metrics.jsonl is the run's log; move it away"):
        trim_metrics(str(tmp_path / "metrics.jsonl"), 8)
