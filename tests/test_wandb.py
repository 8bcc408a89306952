"""Weights & Biases tracking, offline (WANDB_MODE=offline: no network, no account): a tiny run with
wandb_project set, stopped by SIGTERM and resumed, logs every metrics.jsonl record to one W&B run, config
included. What W&B stored is read back from its own run files (.wandb: a LevelDB-style log of W&B's protobuf
records, read here with wandb's protobuf classes), not from our code."""

import glob
import importlib.util
import json
import os
import signal
import subprocess
import time

import pytest

from support.checks import check_wandb
from test_train import ROOT, data_dir, metrics, train_cmd  # noqa: F401 (fixtures)
from train import Config

BLOCK = 32768  # the log's block size: a record header never straddles a block


def wandb_records(path):
    """The protobuf Records of a .wandb file: a 7-byte file header (':W&B', magic, version), then records of
    (crc32 4 bytes, length 2, type 1) + payload, split FIRST/MIDDLE/LAST across blocks, or FULL."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7 or data[pos + 4:pos + 7] == b"\0\0\0":  # block trailer / zero padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record
            payload = b""


def read_offline_run(run_dir):
    """-> (the run record, {step: {key: value}} of its history), from a W&B offline run directory."""
    run, history = None, {}
    for record in wandb_records(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return run, history


def test_wandb_offline_logs_every_record_and_a_resume_continues_the_same_run(data_dir, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    out = tmp_path / "run"
    cmd = train_cmd(out, data_dir, f"--tokens={40 * 8 * 64}", "--log_interval=2", "--wandb_project=clm-detour-test",
                    "--wandb_run_name=tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stdout[-2000:] + stderr[-2000:]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0 and "resuming at step" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]

    run_id = (out / "wandb_id").read_text().strip()
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(d.endswith("-" + run_id) for d in runs), runs
    (first, logged_first), (second, logged_second) = map(read_offline_run, runs)
    for run in (first, second):  # one W&B run: the same id, project and name, the config recorded
        assert (run.run_id, run.project, run.display_name) == (run_id, "clm-detour-test", "tiny")
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["lr"] == 3e-3 and config["objective"] == "clm" and config["out_dir"] == str(out)
    assert max(logged_first) < min(logged_second)  # the resumed run continues after the stop
    records = metrics(out)
    assert {**logged_first, **logged_second} == {m["step"]: m for m in records}  # every record, every value
    print(f"\nW&B offline: run {run_id}, {len(logged_first)} + {len(logged_second)} records across the SIGTERM "
          f"(steps {min(logged_first)}-{max(logged_first)}, then {min(logged_second)}-{max(logged_second)})")


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="wandb is not installed: pip install wandb"):
        check_wandb(Config(out_dir=str(tmp_path), wandb_project="p"))
