"""keep_every and cka.py --runs: checkpoints kept for a trajectory survive max_ckpts weights-only, resume
ignores them, and the trajectory over two tiny runs equals --pair step by step and the float64 textbook
CKA on transformers' own forward pass."""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from support.checkpoint import latest_valid_checkpoint, step_checkpoints, weights_only
from support.metrics import TIMINGS
from test_cka import gram_cka
from test_train import ROOT, base_ckpt, data_dir, metrics, run_train  # noqa: F401 (fixtures)

# 16 main + 4 decay steps (test_train's tiny run). Full checkpoints every 8 steps and at each phase end,
# the newest 2 kept; every 6th step kept weights-only: 6 and 12 and 18 are trajectory points only.
KEEP = ["--keep_every=6", "--max_ckpts=2", "--ckpt_interval=8", "--eval_interval=100", "--log_interval=4"]
ARMS = {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"], "mlm_twin": ["--objective=mlm", "--seed=42"]}


@pytest.fixture(scope="module")
def runs(data_dir, base_ckpt, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("runs")
    for name, overrides in ARMS.items():
        run_train(str(tmp / name), data_dir, f"--init_from={base_ckpt}", *KEEP, *overrides)
    rng = random.Random(1)
    nouns, verbs = ["cell", "gene", "protein", "tumor", "patient", "dose", "virus"], ["binds", "inhibits", "treats"]
    texts = [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} a {rng.choice(nouns)}."
                      for _ in range(rng.randint(1, 5))) for _ in range(60)]
    (tmp / "texts.txt").write_text("\n".join(texts))
    return tmp


def steps_in(run):
    return {int(os.path.basename(p).split("-")[1]): weights_only(p) for p in step_checkpoints(str(run))}


def test_keep_every_checkpoints_survive_max_ckpts_weights_only(runs):
    # 8 was full, then dropped by max_ckpts (not a multiple of 6); 16 and 20 are the newest 2 full ones.
    assert steps_in(runs / "clm") == {6: True, 12: True, 16: False, 18: True, 20: False}
    for step in (6, 12, 18):
        ckpt = runs / "clm" / f"ckpt-{step}"
        assert not (ckpt / "train_state.pt").exists()
        assert json.loads((ckpt / "progress.json").read_text()) == {
            "step": step, "tokens": step * 8 * 64, "phase": "main" if step <= 16 else "decay"}
        from transformers import AutoModelForMaskedLM  # a Hugging Face directory as it is
        AutoModelForMaskedLM.from_pretrained(ckpt)


def test_resume_picks_the_newest_full_checkpoint_not_a_weights_only_one(runs, data_dir, base_ckpt, tmp_path):  # noqa: F811
    # The out_dir as a kill between steps 18 and 20 leaves it: the newest checkpoint is weights-only.
    run = tmp_path / "clm"
    shutil.copytree(runs / "clm", run)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "ckpt-20")
    assert latest_valid_checkpoint(str(run)) == str(run / "ckpt-16")
    r = run_train(str(run), data_dir, f"--init_from={base_ckpt}", *KEEP, *ARMS["clm"])
    assert "resuming at step 16" in r.stdout
    strip = lambda records: [{k: v for k, v in m.items() if k not in TIMINGS} for m in records]  # noqa: E731
    assert strip(metrics(run)) == strip(metrics(runs / "clm"))
    assert steps_in(run) == steps_in(runs / "clm")
    for name in ("model.safetensors", "progress.json"):
        assert (run / "final" / name).read_bytes() == (runs / "clm" / "final" / name).read_bytes()


def cka(runs, out, *args):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "cka.py"), "--texts", str(runs / "texts.txt"), "--n", "40",
                        "--seeds", "1,2", "--max_len", "48", "--device", "cpu", "--out", str(out), *args],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def trajectory(runs):
    r = cka(runs, runs / "traj", "--runs", str(runs / "clm"), str(runs / "mlm"),
            "--control", str(runs / "mlm"), str(runs / "mlm_twin"))
    assert r.stdout.count("divergence by region, pair") == 5  # progress: a line per step (the bar is off on a pipe)
    return json.loads((runs / "traj" / "trajectory.json").read_text())


def test_trajectory_has_every_common_step_and_its_place_in_the_run(runs, trajectory):
    common = sorted(set(steps_in(runs / "clm")) & set(steps_in(runs / "mlm")))
    assert [p["step"] for p in trajectory["steps"]] == common == [6, 12, 16, 18, 20]
    assert [p["phase"] for p in trajectory["steps"]] == ["main", "main", "main", "decay", "decay"]
    assert [p["tokens"] for p in trajectory["steps"]] == [s * 8 * 64 for s in common]
    last = trajectory["steps"][-1]  # the final checkpoints stand for their own step
    assert last["pair"]["checkpoints"] == [str(runs / "clm" / "final"), str(runs / "mlm" / "final")]
    for p in trajectory["steps"]:
        assert len(p["pair"]["layers"]) == len(p["control"]["layers"]) == 4
        assert len(p["pair"]["regions"]) == len(p["ratio"]) == 3
    table = (runs / "traj" / "trajectory.md").read_text()
    assert table.count("\n| ") == 1 + len(common)  # the header and one row per step
    assert (runs / "traj" / "trajectory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_step_equals_pair_on_the_same_two_checkpoints_exactly(runs, trajectory, tmp_path):
    ckpt = lambda name: str(runs / name / "ckpt-12")  # noqa: E731  (weights-only checkpoints)
    cka(runs, tmp_path, "--pair", ckpt("clm"), ckpt("mlm"), "--control", ckpt("mlm"), ckpt("mlm_twin"))
    pair = json.loads((tmp_path / "results.json").read_text())
    point = next(p for p in trajectory["steps"] if p["step"] == 12)
    for name in ("pair", "control"):
        for layer, value in enumerate(point[name]["layers"]):
            assert value == pair["layers"][str(layer)][f"{name}_divergence"]  # mean, std, per seed: bit for bit
        for region, value in zip(pair["regions"], point[name]["regions"]):
            assert value == region[f"{name}_divergence"]


def test_trajectory_equals_textbook_cka_on_transformers_forward(runs, trajectory):
    """The independent reference: transformers' ModernBERT, one text at a time, hidden states mean-pooled,
    and the n x n Gram-matrix CKA in float64 (test_cka.gram_cka), at one weights-only step."""
    from transformers import AutoModelForMaskedLM

    texts = (runs / "texts.txt").read_text().split("\n")
    point = next(p for p in trajectory["steps"] if p["step"] == 6)

    def pooled(ckpt):  # (texts, layers, H) float64
        tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
        model = AutoModelForMaskedLM.from_pretrained(ckpt).eval()
        cls, sep = model.config.cls_token_id, model.config.sep_token_id
        outputs = []  # each layer's output (its hidden_states end after the final norm, so hooks instead)
        for layer in model.model.layers:
            layer.register_forward_hook(lambda m, i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        rows = []
        with torch.no_grad():
            for text in texts:
                ids = [cls] + tok.encode(text, add_special_tokens=False).ids[:46] + [sep]
                outputs.clear()
                model(torch.tensor([ids]))
                rows.append([h[0].double().mean(0).numpy() for h in outputs])  # (layers, H)
        return np.array(rows)

    a, b = (pooled(p) for p in point["pair"]["checkpoints"])
    assert a.shape[1] == 4
    for layer in range(4):
        reference = [1 - gram_cka(a[draw, layer], b[draw, layer])
                     for draw in (np.random.default_rng(s).choice(len(texts), 40, replace=False) for s in (1, 2))]
        assert point["pair"]["layers"][layer]["per_seed"] == pytest.approx(reference, abs=1e-5)
