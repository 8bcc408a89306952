"""
The model card: README.md in every checkpoint directory (ckpt-STEP/ and final/), as the Hugging Face hub renders it.
"""

import os
import re

from support.files import number, open_file, read_bytes, read_json
from support.metrics import METRICS, lr_shape, records
from support.shards import COUNTS, load_meta


def base_model(init_from):
    """The hub id of the model this run continues, where it can be known (a hub cache path .../models--ORG--NAME/...,
    a config.json's _name_or_path, our card's base_model); None from scratch or from an unnamed local copy."""
    if init_from == "scratch":
        return None
    if cached := re.search(r"models--([\w.-]+?)--([\w.-]+)", init_from):
        return f"{cached[1]}/{cached[2]}"
    try:
        name = read_json(os.path.join(init_from, "config.json")).get("_name_or_path", "")
        if isinstance(name, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not os.path.exists(name):
            return name
        card = read_bytes(os.path.join(init_from, "README.md"), 1 << 20).decode("utf-8", errors="replace")
        found = re.search(r"^base_model: (\S+)$", card.split("\n---", 1)[0], re.M)
        return found[1] if found else None
    except (OSError, ValueError):
        return None


def latest_records(out_dir, step):
    """The last record of metrics.jsonl at or before `step`, and the last one with validation losses; a record
    without the numbers the card prints (a hand-edited one) is passed over."""
    last = val = None
    for record in records(os.path.join(out_dir, METRICS)):
        if record["step"] <= step and number(record.get("loss")):
            last = record
            has_val = all(number(record.get(k)) for k in ("val_mlm_loss", "val_clm_loss", "tokens"))
            val = record if has_val and isinstance(record.get("phase"), str) else val
    return last, val


def recipe_rows(schedule, c, step):
    """The recipe table: per phase its objective, attention, masking, length, lr shape and status at `step`."""
    rows, per_step = [], c.global_batch_size * c.seq_len
    for phase, n, start in zip(schedule.phases, schedule.steps, schedule.starts):
        done = "done" if step >= start + n else (f"{step - start} of {n} steps" if step > start else "not started")
        rows.append(f"| {phase.name} | {phase.objective} | {'causal' if phase.causal else 'bidirectional'} | "
                    f"{f'{phase.mask_prob:.0%}' if phase.objective == 'mlm' else 'none (next token)'} | "
                    f"{n * per_step:,} | {n:,} | {lr_shape(phase, c.lr)} | {done} |")
    return rows


def write_card(directory, c, step, tokens, model, schedule=None):
    """README.md in the checkpoint directory being written, for the run of config `c` at `step` of `schedule`."""
    meta = load_meta(c.data_dir)  # as the run's start-up checked it
    # where the directory ends up (it is written under a temporary name, then renamed)
    path = os.path.join(c.out_dir, os.path.basename(directory).removeprefix(".tmp-"))
    per_step = c.global_batch_size * c.seq_len
    hub = base_model(c.init_from)
    tags = ["modernbert", "fill-mask", "clm-detour", "continued-pretraining" if c.init_from != "scratch"
            else "pretraining", *sorted({p.objective for p in schedule.phases} if schedule else ())]
    front = ["---", "library_name: transformers", "pipeline_tag: fill-mask", *([f"base_model: {hub}"] if hub else []),
             "tags:", *(f"- {t}" for t in tags), "---"]

    last, val = latest_records(c.out_dir, step)
    losses = ["No evaluation yet."]
    if val:
        losses = [f"At step {val['step']:,} ({val['phase']} phase, {val['tokens']:,} tokens):", "",
                  "| val MLM loss (15% masking) | val CLM loss | train loss |", "|---|---|---|",
                  f"| {val['val_mlm_loss']:.4f} | {val['val_clm_loss']:.4f} | {val['loss']:.4f} |"]
    if last and last is not val:
        losses += ["", f"Latest training loss: {last['loss']:.4f} at step {last['step']:,}."]
    frozen = f"; layers {c.freeze_layers} frozen in {c.freeze_phase}" if c.freeze_layers else ""
    sha = meta.get("tokenizer_sha256")
    counts = (f"{meta['train_tokens']:,} training tokens in {meta['train_docs']:,} documents; {meta['val_tokens']:,} "
              f"validation tokens in {meta['val_docs']:,} documents. " if all(k in meta for k in COUNTS) else "")

    lines = [*front, "", f"# {os.path.basename(os.path.abspath(c.out_dir))}", "",
             f"A ModernBERT encoder ({model.num_params():,} parameters, {model.config.num_hidden_layers} "
             f"layers) trained with the clm-detour codebase from `{c.init_from}`: step {step:,}"
             f"{f' of {schedule.starts[-1]:,}' if schedule else ''}, {tokens:,} tokens.", "",
             "## Recipe", "",
             "| phase | objective | attention | masking | tokens | steps | lr | status |",
             "|---|---|---|---|---|---|---|---|", *(recipe_rows(schedule, c, step) if schedule else []), "",
             f"AdamW (decoupled weight decay {c.weight_decay:g}, betas {tuple(c.betas)}, eps {c.eps:g}); "
             f"{c.global_batch_size} sequences of {c.seq_len} tokens per step ({per_step:,} tokens){frozen}.", "",
             "## Data", "",
             *(f"- {s}" for s in meta.get("sources") or ["(not recorded)"]), "",
             f"{counts}Tokenizer `{meta.get('tokenizer', '(not recorded)')}` ({meta['vocab_size']:,} tokens"
             f"{f', sha256 {sha}' if sha else ''}).", "",
             "## Seeds", "", f"seed {c.seed} (init, masking, dropout), data_seed {c.data_seed} (data order).", "",
             "## Validation", "", *losses, "",
             "## How to load", "",
             "```python",
             "from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline",
             f"path = {path!r}  # this directory, or its hub id once uploaded",
             "model = AutoModelForMaskedLM.from_pretrained(path)",
             "tokenizer = AutoTokenizer.from_pretrained(path)",
             "fill = pipeline(\"fill-mask\", model=path)",
             "print(fill(f\"The patient was treated with {tokenizer.mask_token}.\"))",
             "```", "",
             f"In the clm-detour codebase: `model.ModernBertForMaskedLM.from_pretrained({path!r})`; "
             f"`train.py --init_from={path}` continues from it.", ""]
    with open_file(os.path.join(directory, "README.md")) as f:
        f.write("\n".join(lines))
