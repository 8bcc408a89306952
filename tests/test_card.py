"""What an exported checkpoint directory carries for the Hugging Face world: a model card (README.md) whose
numbers are the run's (metrics.jsonl, meta.json, the tokenizer file's sha256), and tokenizer files with which
transformers' own `pipeline("fill-mask")` runs, for a tokenizer trained here (bpe:N) and for copied ones
(../shared/tokenizers), with transformers' ids equal to Hugging Face tokenizers' and its scores our model's."""

import glob
import hashlib
import importlib.util
import json
import os
import random
import subprocess

import pytest
import tokenizers
import torch
import yaml
from safetensors.torch import load_file

from data import prepare, read_documents
from model import ModernBertConfig, ModernBertForMaskedLM
from support.checkpoint import checkpoint_problem, save_checkpoint
from test_resilience import logged, stop, wait_for
from test_train import ROOT, TINY, data_dir, metrics, train_cmd, train_here  # noqa: F401 (fixtures)
from train import Config, make_optimizer, parse_config

TEXT = "the patient was treated with a [MASK] dose."


def front_matter(card):  # as the hub reads it
    return yaml.safe_load(card.split("---\n")[1])


def check_fill_mask(path):
    """transformers' pipeline("fill-mask") knows the special tokens and the maximum length, its ids are those of
    tokenizers itself, its top scores our model's softmax at the [MASK]."""
    from transformers import AutoTokenizer, pipeline

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.mask_token, tokenizer.pad_token, tokenizer.cls_token, tokenizer.sep_token) == (
        "[MASK]", "[PAD]", "[CLS]", "[SEP]")
    assert tokenizer.model_max_length == ModernBertConfig().max_position_embeddings
    ids = tokenizer(TEXT)["input_ids"]
    reference = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert ids == reference.encode(TEXT).ids
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=False)
    results = pipeline("fill-mask", model=path, top_k=3)(TEXT)
    ours = ModernBertForMaskedLM.from_pretrained(path).eval()
    with torch.no_grad():
        probs = ours(torch.tensor([ids]))[0, ids.index(tokenizer.mask_token_id)].softmax(-1)
    top = probs.topk(3)
    assert [r["token"] for r in results] == top.indices.tolist()
    assert [r["score"] for r in results] == pytest.approx(top.values.tolist(), rel=1e-4)
    return results


def test_card_numbers_are_the_runs_and_fill_mask_runs_with_a_trained_tokenizer(data_dir, tmp_path):
    """A tiny run from scratch with a BPE trained here (tokenizer.json alone in the data): every ckpt-*/ and
    final/ has a card with the run's numbers, and pipeline("fill-mask") works on final/."""
    out = tmp_path / "run"
    train_here(out, data_dir, "--decay_frac=0.25", "--ckpt_interval=6", "--eval_interval=6", "--max_ckpts=10")
    records, meta = metrics(out), json.load(open(os.path.join(data_dir, "meta.json")))
    sha = hashlib.sha256(open(os.path.join(data_dir, "tokenizer.json"), "rb").read()).hexdigest()
    dirs = sorted(out.glob("ckpt-*"), key=lambda d: int(d.name[5:])) + [out / "final"]
    assert [d.name for d in dirs] == ["ckpt-6", "ckpt-12", "ckpt-16", "ckpt-18", "ckpt-20", "final"]
    for d in dirs:
        assert checkpoint_problem(str(d)) is None  # the card and tokenizer files are in the manifest
        card = (d / "README.md").read_text()
        front = front_matter(card)
        assert front["library_name"] == "transformers" and front["pipeline_tag"] == "fill-mask"
        assert "base_model" not in front and {"clm-detour", "pretraining", "clm", "mlm"} <= set(front["tags"])
        step = int(torch.load(d / "train_state.pt", weights_only=False)["step"])
        val = [r for r in records if r["step"] <= step and "val_mlm_loss" in r][-1]
        assert (f"At step {val['step']:,} ({val['phase']} phase, {val['tokens']:,} tokens):" in card
                and f"| {val['val_mlm_loss']:.4f} | {val['val_clm_loss']:.4f} | {val['loss']:.4f} |" in card), card
        assert f"step {step:,} of 20, {step * 512:,} tokens" in card
        # the recipe: 16 CLM steps (warmup 4 steps), 4 MLM-15% decay steps, 512 tokens each, lr 3e-3
        assert "| main | clm | causal | none (next token) | 8,192 | 16 | warmup over 2,048 tokens, then 0.003 |" in card
        assert "| decay | mlm | bidirectional | 15% | 2,048 | 4 | 1-sqrt decay from 0.003 to 0.0003 |" in card
        assert f"{meta['train_tokens']:,} training tokens in {meta['train_docs']:,} documents" in card
        assert f"sha256 {sha}" in card
        assert "seed 17 (init, masking, dropout), data_seed 42 (data order)" in card
        stored = sum(t.numel() for t in load_file(d / "model.safetensors").values())  # the tied decoder once
        assert f"path = {str(d)!r}" in card and f"{stored:,} parameters" in card
    assert card.count("| done |") == 2  # final: both phases
    card = (out / "ckpt-12" / "README.md").read_text()
    assert "| 12 of 16 steps |" in card and "| not started |" in card
    results = check_fill_mask(str(out / "final"))
    print(f"\ntrained bpe: fill-mask top 3 {[(r['token_str'], round(r['score'], 4)) for r in results]}")


@pytest.mark.parametrize("name", ["modernbert", "camembertv2"])
def test_fill_mask_runs_with_a_copied_tokenizer(name, tmp_path):
    """Data prepared with a real tokenizer copied from ../shared (its own tokenizer_config.json travels with it),
    a checkpoint written from it: transformers reads it right (CamemBERTv2's "RobertaTokenizer" class would
    split words into characters), and the card names the hub model init_from came from."""
    source = os.path.join(ROOT, "..", "shared", "tokenizers", name)
    if not os.path.isdir(source):
        pytest.skip("../shared (the real tokenizers) is not beside the checkout")
    rng = random.Random(0)
    words = ["patient", "dose", "treated", "tumor", "gene", "protein", "cell", "virus", "the", "a", "with"]
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(60)))
    data = str(tmp_path / "data")
    meta = prepare(lambda: read_documents([str(tmp_path / "corpus.txt")]), source, data, val_docs=10)
    torch.manual_seed(0)
    ids = dict(pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
               bos_token_id=meta["cls_id"], eos_token_id=meta["sep_id"])
    model = ModernBertForMaskedLM(ModernBertConfig(vocab_size=64 * -(-meta["vocab_size"] // 64), **ids, **TINY))
    init_from = str(tmp_path / "hub" / "models--answerdotai--ModernBERT-base" / "snapshots" / "0123abc")
    c = Config(data_dir=data, out_dir=str(tmp_path / "out"), init_from=init_from, seq_len=64, global_batch_size=8)
    path = os.path.join(c.out_dir, "ckpt-0")
    save_checkpoint(path, model, make_optimizer(model, c, torch.device("cpu")), {"step": 0, "tokens": 0}, c)
    front = front_matter(open(os.path.join(path, "README.md")).read())
    assert front["base_model"] == "answerdotai/ModernBERT-base" and "continued-pretraining" in front["tags"]
    results = check_fill_mask(path)
    print(f"\n{name}: fill-mask top 3 {[(r['token_str'], round(r['score'], 4)) for r in results]}")


BLOCK = 32768  # the log's block size: a record header never straddles a block


def wandb_records(path):
    """What W&B offline stored, read from its own run file, not from our code: the protobuf Records of a .wandb file
    (a LevelDB-style log): a 7-byte file header (':W&B', magic, version), then records of (crc32 4 bytes, length 2,
    type 1) + payload, split FIRST/MIDDLE/LAST across blocks, or FULL."""
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
            yield wandb_internal_pb2.Record.FromString(payload)
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
    # a tiny run stopped by SIGTERM and resumed: every metrics.jsonl record in one W&B run, config included
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    out = tmp_path / "run"
    cmd = train_cmd(out, data_dir, f"--tokens={40 * 8 * 64}", "--log_interval=2", "--wandb_project=clm-detour-test",
                    "--wandb_run_name=tiny")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    wait_for(lambda: logged(out) >= 6, proc, "three records")  # a record every 2 steps
    code, stdout, stderr = stop(proc)
    assert code == 143, stdout[-2000:] + stderr[-2000:]
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
    assert {**logged_first, **logged_second} == {m["step"]: m for m in metrics(out)}  # every record, every value
    print(f"\nW&B offline: run {run_id}, {len(logged_first)} + {len(logged_second)} records across the SIGTERM "
          f"(steps {min(logged_first)}-{max(logged_first)}, then {min(logged_second)}-{max(logged_second)})")


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="wandb is not installed: pip install wandb"):
        parse_config([f"--out_dir={tmp_path}", "--wandb_project=p"])
