"""The papers' runs as written (issue 33): the freeze configs, phases in optimizer steps, Gisserot-Boukhlef's
biphasic schedule and MLM continued pretraining, seq_len past the positions, and what a run with phases keeps."""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from model import ModernBertConfig, ModernBertForMaskedLM
from support.config import differences
from train import Config, Schedule, parse_config
from test_train import TIMINGS, TINY, base_ckpt, config, data_dir, metrics, train_here  # noqa: F401 (fixtures)


# -----------------------------------------------------------------------------
# 1. The freeze configs run the paper's freeze


@pytest.mark.parametrize("name, layers, phase", [("freeze_0_7_clm.py", "0-7", "main"),
                                                 ("freeze_0_7_decay.py", "0-7", "decay"),
                                                 ("freeze_8_14_clm.py", "8-14", "main")])
def test_freeze_configs_parse_to_the_papers_zero_grad(name, layers, phase):
    for base in ("fr_base.py", "en_base.py"):
        c = config(base, name)
        assert (c.freeze_layers, c.freeze_phase, c.freeze_mode) == (layers, phase, "zero_grad")
    assert config("fr_base.py", name, argv=["--freeze_mode=exact"]).freeze_mode == "exact"  # the clean variant


# -----------------------------------------------------------------------------
# 2. A phase given in steps


STEPS = [{"name": "main", "objective": "clm", "steps": 16, "warmup_steps": 4},
         {"name": "decay", "objective": "mlm", "mask_prob": 0.15, "steps": 4, "decay": True}]


def test_a_phase_in_steps_has_the_schedule_of_the_same_phase_in_tokens():
    """512 tokens a step: 8,192 tokens are 16 steps, a 2,048-token warmup 4 steps, a 25% decay 4 steps; 8,000
    tokens round up to the same 16 steps. Written in steps, the schedule is the same step for step."""
    per_step = dict(global_batch_size=8, seq_len=64, lr=3e-3)
    tokens = Schedule(Config(tokens=8192, warmup_tokens=2048, decay_frac=0.25, **per_step))
    rounded = Schedule(Config(tokens=8000, warmup_tokens=2000, decay_frac=0.256, **per_step))
    steps = Schedule(Config(phases=STEPS, **per_step))
    for s in (tokens, rounded, steps):
        assert (s.steps, s.warmup_steps, s.starts) == ([16, 4], [4, 0], [0, 16, 20])
        assert [s.at(k).name for k in range(20)] == ["main"] * 16 + ["decay"] * 4
        expect = [3e-3 * (k + 1) / 4 for k in range(4)] + [3e-3] * 12 + \
                 [3e-3 * (0.1 + 0.9 * (1 - math.sqrt(t / 4))) for t in range(4)]
        assert [s.lr_at(k) for k in range(20)] == pytest.approx(expect, rel=1e-12)
    # steps do not move with the batch: twice the tokens per step halves a token phase, not a steps phase
    wide = dict(per_step, global_batch_size=16)
    assert Schedule(Config(tokens=8192, warmup_tokens=2048, decay_frac=0.25, **wide)).steps == [8, 2]
    assert Schedule(Config(phases=STEPS, **wide)).steps == [16, 4]


def run_record(out_dir):
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics(out_dir)]


def test_a_run_in_steps_is_the_run_in_tokens_and_resumes_and_splits_alike(data_dir, base_ckpt, tmp_path):  # noqa: F811
    """test_train's tiny run with its phases in steps: the run in tokens, bit for bit, again when resumed mid-main as
    run_phases=main then continued by run_phases=decay; the log and the card say how each length was given."""
    common = [f"--init_from={base_ckpt}", "--max_ckpts=10"]
    r = train_here(tmp_path / "tokens", data_dir, *common)
    assert "8,192 tokens -> 16 steps" in r.stdout
    r = train_here(tmp_path / "steps", data_dir, *common, f"--phases={STEPS!r}")
    assert "16 steps = 8,192 tokens" in r.stdout and "warmup over 4 steps" in r.stdout
    whole = run_record(tmp_path / "steps")
    assert whole == run_record(tmp_path / "tokens") and whole[-1]["step"] == 20
    in_tokens, in_steps = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("tokens", "steps"))
    assert all(torch.equal(in_steps[k], v) for k, v in in_tokens.items())
    card = (tmp_path / "steps" / "final" / "README.md").read_text()
    assert "| main | clm | causal | none (next token) | 8,192 | 16 | warmup over 4 steps, then 0.003 | done |" in card

    run = tmp_path / "steps"
    for later in [d for d in os.listdir(run) if d == "final" or d.startswith("ckpt-") and int(d[5:]) > 8]:
        shutil.rmtree(run / later)  # as if the run had died after writing ckpt-8
    r = train_here(run, data_dir, *common, f"--phases={STEPS!r}", "--run_phases=main")
    assert "resuming at step 8" in r.stdout
    train_here(tmp_path / "decay", data_dir, f"--init_from={run / 'final'}", f"--phases={STEPS!r}",
               "--run_phases=decay")
    assert run_record(run) + run_record(tmp_path / "decay") == whole


# -----------------------------------------------------------------------------
# 3. Gisserot-Boukhlef et al.'s schedules, as configs


@pytest.mark.parametrize("argv", [[], ["--global_batch_size=96", "--seq_len=1024"]])
def test_biphasic_and_mlm_from_clm_configs_are_their_schedules(argv):
    """Their largest budget, 42,000 steps whatever the batch: CLM for 25%, then MLM at 40%, the decay (1-sqrt to 0.1
    lr) only in the final 2,000 steps; the 2,000-step warmup is our choice. Then their continued pretraining: 12,000
    MLM steps at 40% from the end of that CLM phase."""
    c = config("en_base.py", "biphasic_scratch.py", argv=argv)
    s, peak = Schedule(c), 2e-4
    assert c.init_from == "scratch" and s.starts == [0, 10_500, 40_000, 42_000] and 10_500 / 42_000 == 0.25
    at = [0, 10_499, 10_500, 39_999, 40_000, 41_999]
    assert [(s.at(k).objective, s.at(k).mask_prob, s.at(k).causal) for k in at] == \
        [("clm", 0, True)] * 2 + [("mlm", 0.4, False)] * 4
    assert s.lr_at(0) == pytest.approx(peak / 2000) and s.lr_at(999) == pytest.approx(peak / 2)
    assert all(s.lr_at(k) == peak for k in (1999, 5000, 10_499, 10_500, 25_000, 39_999, 40_000))  # no decay before
    for k, frac in [(40_500, 0.1 + 0.9 * (1 - 0.5)), (41_000, 0.1 + 0.9 * (1 - 0.5 ** 0.5)),
                    (41_999, 0.1 + 0.9 * (1 - (1999 / 2000) ** 0.5))]:
        assert s.lr_at(k) == pytest.approx(peak * frac, rel=1e-12)
    assert s.lr_at(41_999) == pytest.approx(2.0045e-5, rel=1e-4)  # 0.1 lr + 0.9 lr x (1 - 0.99975)

    c = config("en_base.py", "mlm_from_clm.py", argv=argv)
    s = Schedule(c)
    assert s.starts == [0, 10_000, 12_000] and {(p.objective, p.mask_prob) for p in s.phases} == {("mlm", 0.4)}
    assert s.lr_at(9_999) == peak and s.lr_at(11_000) == pytest.approx(peak * (0.1 + 0.9 * (1 - 0.5 ** 0.5)))
    assert c.init_from == "out/en_base_biphasic_scratch/ckpt-10500" and c.out_dir == "out/en_base_mlm_from_clm"


# -----------------------------------------------------------------------------
# 4. seq_len beyond the model's positions is refused at start-up and on resume, with the fix


def test_seq_len_beyond_the_positions_is_refused_at_start_up_and_on_resume(data_dir, tmp_path):  # noqa: F811
    """Before any work, naming the fix: a checkpoint of 32 positions at seq_len 64 (it would train without a word, its
    config.json says 32), model_config's positions from scratch, and a run of it resumed at seq_len 64, though
    resume_changes allows the change of key (init_from is not read on resume: the run's own checkpoints are)."""
    short, run = tmp_path / "short", tmp_path / "run"
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, max_position_embeddings=32, **TINY)).save_pretrained(short)
    r = train_here(run, data_dir, f"--init_from={short}", check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"seq_len=64 is beyond init_from={short}'s max_position_embeddings=32: use --seq_len=32 or less, or a "
        "checkpoint with 64 positions or more")
    assert not run.exists()  # nothing was written
    with pytest.raises(SystemExit, match="seq_len=64 is beyond model_config's max_position_embeddings=32: use "
                                         "--seq_len=32 or less, or set model_config's max_position_embeddings to 64"):
        parse_config(["--model_config={'max_position_embeddings': 32}", "--seq_len=64", "--init_from=scratch"])
    assert parse_config(["--model_config={'max_position_embeddings': 64}", "--seq_len=64", "--init_from=scratch"])

    args = [f"--init_from={short}", "--seq_len=32", "--run_phases=main", f"--tokens={4 * 8 * 32}", "--warmup_tokens=0"]
    train_here(run, data_dir, *args)  # at seq_len 32, it starts
    r = train_here(run, data_dir, *args, "--seq_len=64", "--resume_changes=seq_len", check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"seq_len=64 is beyond the run in {run}'s max_position_embeddings=32: use --seq_len=32 or less, or a new "
        "out_dir")


# -----------------------------------------------------------------------------
# 5. A run with phases shows the phases in force, keeps every phase's end, and names what a resume changes

THREE = [{"name": "clm", "objective": "clm", "steps": 6, "warmup_steps": 2},
         {"name": "mlm", "objective": "mlm", "mask_prob": 0.4, "steps": 6},
         {"name": "decay", "objective": "mlm", "mask_prob": 0.4, "steps": 4, "decay": True}]
REPLACED = {"objective", "mask_prob", "tokens", "warmup_tokens", "decay_frac", "decay_mask_prob", "final_lr_frac"}


def test_a_run_with_phases_shows_them_keeps_their_ends_and_names_a_change(data_dir, base_ckpt, tmp_path):  # noqa: F811
    """max_ckpts 1 keeps every phase end whole; the last two phases from ckpt-6 are the whole run's from step 7 on;
    config.json and the start-up dump leave out the keys the phases replace; a refused resume names each change."""
    args = [f"--init_from={base_ckpt}", f"--phases={THREE!r}", "--ckpt_interval=4", "--max_ckpts=1"]
    r = train_here(tmp_path / "run", data_dir, *args)
    dumped = json.loads(r.stdout[:r.stdout.index("\n}\n") + 2])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert dumped == saved and saved["phases"] == THREE and not REPLACED & set(saved)
    assert "decay  steps 12-15  4 steps = 2,048 tokens" in r.stdout
    kept = sorted(int(d[5:]) for d in os.listdir(tmp_path / "run") if d.startswith("ckpt-"))
    assert kept == [6, 12, 16] and all((tmp_path / "run" / f"ckpt-{k}" / "train_state.pt").is_file() for k in kept)

    train_here(tmp_path / "branch", data_dir, *args, f"--init_from={tmp_path / 'run' / 'ckpt-6'}",
               "--run_phases=mlm,decay")
    assert run_record(tmp_path / "branch") == [m for m in run_record(tmp_path / "run") if m["step"] > 6]

    changed = [THREE[0], {**THREE[1], "steps": 8}, THREE[2]]
    r = train_here(tmp_path / "run", data_dir, *args[:1], f"--phases={changed!r}", *args[2:], check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        f"{tmp_path / 'run'} holds a run with other settings: phases[1].steps 6 -> 8. Resuming would change what the "
        "run is: choose a new out_dir, or, if the change is deliberate, --resume_changes=phases")
    assert differences("phases", THREE, THREE) == []
    assert differences("phases", THREE, [THREE[0], {**THREE[1], "mask_prob": 0.3, "tokens": 9}]) == [
        "phases[1].mask_prob 0.4 -> 0.3", "phases[1].tokens (unset) -> 9", "phases: 3 entries -> 2"]
    assert differences("model_config", {"hidden_size": 32}, {"hidden_size": 64, "num_hidden_layers": 2}) == [
        "model_config.hidden_size 32 -> 64", "model_config.num_hidden_layers (unset) -> 2"]
    assert differences("objective", "clm", "mlm") == ["objective 'clm' -> 'mlm'"]
