"""
The start-up checks of a training run: everything that can be known at step 0 is checked before any
compute, so that no run dies hours in for a condition it had from the start (a validation split too
small for the first evaluation, an out_dir it cannot write, an init_from it cannot read). Each problem
is one line naming it and the fix. Every rank runs the same checks on the same files and stops alike,
before any rank waits in a collective. `checkpoint_config` is the check eval.py and cka.py share.
"""

import glob
import importlib.util
import os
import sys
from dataclasses import fields

import numpy as np

from data import load_meta
from model import ModernBertConfig, load_config
from support.checkpoint import check_tokenizer
from support.config import check_out_dir
from support.tokenizer import SPECIAL_NAMES


POSITIVE = ("seq_len", "global_batch_size", "micro_batch_size", "lr", "eps", "log_interval", "eval_interval",
            "eval_windows", "ckpt_interval", "max_ckpts", "dist_timeout_minutes")
NOT_NEGATIVE = ("weight_decay", "ckpt_every_minutes", "keep_every", "peak_tflops", "skip_tokens")
PROBABILITIES = ("embedding_dropout", "attention_dropout", "attn_out_dropout", "mlp_dropout")  # in [0, 1)


def check_values(c):
    """Each number of the config in its range, before any other check divides by one of them."""
    bad = ([f"{k}={getattr(c, k)} must be positive" for k in POSITIVE if not getattr(c, k) > 0]
           + [f"{k}={getattr(c, k)} must be 0 or more" for k in NOT_NEGATIVE if getattr(c, k) < 0]
           + [f"{k}={getattr(c, k)} must be in [0, 1)" for k in PROBABILITIES if not 0 <= getattr(c, k) < 1])
    if len(c.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in c.betas):
        bad.append(f"betas={c.betas} must be two numbers in [0, 1), e.g. (0.9, 0.98)")
    if bad:
        raise SystemExit(f"{'; '.join(bad)}: fix the config or the --key=value")


def check_run(c, steps, world):
    """-> the data's meta.json, once the run `c` (`steps` optimizer steps on `world` processes) can start."""
    check_model_config(c)
    check_wandb(c)
    if not c.data_dir:
        raise SystemExit("data_dir is not set: point it at a directory made by `python data.py`")
    try:
        meta = load_meta(c.data_dir)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    missing = [k for k in ("vocab_size", "dtype", *SPECIAL_NAMES) if k not in meta]
    if missing:
        raise SystemExit(f"{c.data_dir}/meta.json lacks {', '.join(missing)}: prepare the data again with "
                         "`python data.py`")
    step_windows = c.micro_batch_size * world  # what one forward on every rank takes
    train, val = (windows(c.data_dir, split, meta["dtype"], c.seq_len) for split in ("train", "val"))
    for split, n, fix in [("train", train, "use more data"),
                          ("val", val, "prepare the data with a larger --val_docs")]:
        if n < step_windows:
            raise SystemExit(f"{c.data_dir}/{split}.bin makes {n} windows of seq_len={c.seq_len}, fewer than one "
                             f"micro batch on every rank needs (micro_batch_size={c.micro_batch_size} x world size "
                             f"{world} = {step_windows}); {fix}, or lower micro_batch_size or seq_len")
    needed = steps * c.global_batch_size
    if needed > train and int(os.environ.get("RANK", 0)) == 0:
        print(f"note: the schedule reads {needed:,} windows of {c.seq_len} tokens and train.bin holds {train:,}: "
              f"the data repeats ({needed / train:.1f} epochs), each epoch in a new order", file=sys.stderr)
    check_out_dir(c.out_dir, "out_dir")
    resuming = glob.glob(os.path.join(c.out_dir, "ckpt-*"))  # then init_from is not read (checkpointer.resume)
    if c.init_from != "scratch" and not resuming:
        check_readable(c.init_from, meta, c.data_dir)
    return meta


def check_wandb(c):
    """wandb (an optional dependency) is installed when the run asks for it, so it is known before any compute."""
    if c.wandb_project and importlib.util.find_spec("wandb") is None:
        raise SystemExit(f"wandb_project={c.wandb_project!r} but wandb is not installed: pip install wandb "
                         "(or leave wandb_project empty)")


def windows(data_dir, split, dtype, seq_len):
    """How many windows of seq_len tokens {split}.bin holds."""
    path = os.path.join(data_dir, f"{split}.bin")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: prepare the data again with `python data.py`")
    return os.path.getsize(path) // np.dtype(dtype).itemsize // seq_len


def check_model_config(c):
    """model_config names ModernBertConfig fields, and from scratch makes a model that can be built: heads
    that split hidden_size into even head dims (RoPE rotates pairs)."""
    keys = [f.name for f in fields(ModernBertConfig)]
    unknown = sorted(set(c.model_config) - set(keys))
    if unknown:
        raise SystemExit(f"model_config: unknown key(s) {', '.join(unknown)}; ModernBertConfig has {', '.join(keys)}")
    defaults = ModernBertConfig()
    numbers = [k for k, v in c.model_config.items() if isinstance(getattr(defaults, k), (int, float))
               and (isinstance(v, bool) or not isinstance(v, (int, float)))]
    if numbers:
        raise SystemExit(f"model_config: {', '.join(f'{k}={c.model_config[k]!r}' for k in numbers)} must be numbers")
    if c.init_from != "scratch":
        return  # the checkpoint brings its own
    preset = {"base": ModernBertConfig.base, "large": ModernBertConfig.large}.get(c.model_size)
    if preset is None:
        raise SystemExit(f"model_size={c.model_size!r}: choose 'base' or 'large' (or set model_config)")
    m = preset(**c.model_config)
    if m.num_attention_heads <= 0 or m.hidden_size % m.num_attention_heads or m.head_dim % 2:
        raise SystemExit(f"model_config: hidden_size={m.hidden_size} must split into num_attention_heads="
                         f"{m.num_attention_heads} heads of an even size (RoPE rotates pairs), e.g. hidden_size 768 "
                         "with 12 heads of 64")


def check_readable(path, meta, data_dir):
    """init_from is a model directory whose config and weights this process can read, with the data's tokenizer."""
    if not os.path.isdir(path):
        raise SystemExit(f"init_from={path!r} is neither 'scratch' nor a checkpoint directory "
                         "(edit the path at the top of the config)")
    weights = [f for f in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, f))]
    if not weights:
        raise SystemExit(f"init_from={path}: no model.safetensors (or pytorch_model.bin): is it a ModernBERT "
                         "checkpoint directory?")
    for name in ("config.json", weights[0]):
        try:
            with open(os.path.join(path, name), "rb") as f:
                f.read(1)
        except OSError as e:
            raise SystemExit(f"init_from={path}: cannot read {name} ({e.strerror})") from None
    try:
        config = load_config(path)
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise SystemExit(f"init_from={path}: {e}") from None
    check_tokenizer(path, config, meta, data_dir)


def checkpoint_config(path, where):
    """-> the ModernBertConfig of the checkpoint directory `path`, once it has a config.json of ModernBERT;
    `where` (e.g. "--model out/x/final") begins the one line that says otherwise."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{where}: not a checkpoint directory (no config.json); give a run's final/ or ckpt-STEP/, "
                         "or a Hugging Face ModernBERT directory")
    try:
        return load_config(path)
    except ValueError as e:  # another architecture's config.json
        raise SystemExit(f"{where}: {e}") from None
