"""support/checks.py: what a run can know at step 0 stops it at start-up, in one line naming the fix
(the validation split against micro batches and ranks under torchrun is in test_resilience.py)."""

import json
import os
import shutil

import pytest

from support.checks import check_run
from test_train import base_ckpt, data_dir  # noqa: F401 (fixtures)
from train import Config

STEPS = 20


def config(data_dir, tmp_path, **kw):
    return Config(**{"data_dir": data_dir, "out_dir": str(tmp_path / "out"), "seq_len": 64, "global_batch_size": 8,
                     "micro_batch_size": 4, **kw})


def test_a_run_that_can_start_passes_and_leaves_no_trace(data_dir, base_ckpt, tmp_path, capsys):
    meta = check_run(config(data_dir, tmp_path, init_from=base_ckpt), STEPS, 2)
    assert meta["vocab_size"] > 0 and not (tmp_path / "out").exists()  # the run makes it, not its checks
    assert capsys.readouterr().err == ""  # 20 steps x 8 windows: less than one epoch, no note


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


def test_data_shorter_than_the_schedule_is_said_to_repeat(data_dir, tmp_path, capsys):
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


def test_missing_data_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="data_dir is not set"):
        check_run(Config(out_dir=str(tmp_path)), STEPS, 1)
    with pytest.raises(SystemExit, match="no meta.json; make the shards first"):
        check_run(Config(data_dir=str(tmp_path), out_dir=str(tmp_path)), STEPS, 1)
