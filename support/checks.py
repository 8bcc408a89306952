"""
The checks made before any work: a config's values and names, a phase, a run's inputs (data, out_dir, init_from),
a checkpoint directory given to eval.py or cka.py. What can be known at step 0 is checked at step 0, so that no run
dies hours in for a condition it had from the start: one line naming it and the fix (a SystemExit), on every rank
alike, before any rank waits in a collective. The formats check themselves where they are read (support/files.py).
"""

import glob
import importlib.util
import os
import sys
from contextlib import contextmanager
from dataclasses import fields

from model import ModernBertConfig
from support import hf, shards
from support.checkpoint import MANIFEST, checkpoint_problem, tokenizer_files
from support.config import check_out_dir
from support.files import sha256
from support.tokenizer import check_vocab

POSITIVE = ("seq_len", "global_batch_size", "micro_batch_size", "lr", "eps", "log_interval", "eval_interval",
            "eval_windows", "ckpt_interval", "max_ckpts", "dist_timeout_minutes")
NOT_NEGATIVE = ("weight_decay", "ckpt_every_minutes", "keep_every", "peak_tflops", "skip_tokens")
PROBABILITIES = ("embedding_dropout", "attention_dropout", "attn_out_dropout", "mlp_dropout")  # in [0, 1)


@contextmanager
def user_error(where=""):
    """What a library call raises for a bad input (a file that is missing, unreadable or of another format)
    becomes the one line a user reads: `where: the problem`."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise SystemExit(f"{where}: {e}" if where else str(e)) from None


# -----------------------------------------------------------------------------
# train.py's config


def check_config(c, phase_names, world):
    """Every value of the config in its range, and the names it gives (phases, layers to freeze) exist."""
    bad = ([f"{k}={getattr(c, k)} must be positive" for k in POSITIVE if not getattr(c, k) > 0]
           + [f"{k}={getattr(c, k)} must be 0 or more" for k in NOT_NEGATIVE if getattr(c, k) < 0]
           + [f"{k}={getattr(c, k)} must be in [0, 1)" for k in PROBABILITIES if not 0 <= getattr(c, k) < 1])
    if len(c.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in c.betas):
        bad.append(f"betas={c.betas} must be two numbers in [0, 1), e.g. (0.9, 0.98)")
    if bad:
        raise SystemExit(f"{'; '.join(bad)}: fix the config or the --key=value")
    if c.compile.lower() not in ("auto", "true", "false"):
        from torch._dynamo import list_backends  # seconds to import: only for a backend's name
        if c.compile not in list_backends(exclude_tags=()):
            raise SystemExit(f"compile={c.compile!r}: choose auto, True, False or a torch.compile backend, e.g. "
                             "inductor or aot_eager (all: torch._dynamo.list_backends(exclude_tags=()))")
    if c.global_batch_size % (c.micro_batch_size * world):
        fits = [m for m in range(c.micro_batch_size, 0, -1) if c.global_batch_size % (m * world) == 0]
        fix = f"e.g. --micro_batch_size={fits[0]}" if fits else f"a global_batch_size that {world} ranks share"
        raise SystemExit(f"global_batch_size={c.global_batch_size} is not a multiple of micro_batch_size="
                         f"{c.micro_batch_size} x world size {world}: each step must give every rank whole micro "
                         f"batches; {fix}")
    run, frozen = c.run_phases.split(","), c.freeze_phase.split(",")
    if run != ["all"] and not any(phase_names[i:i + len(run)] == run for i in range(len(phase_names))):
        raise SystemExit(f"run_phases={c.run_phases!r}: write 'all' or consecutive phase names in order, "
                         f"comma-separated, from {', '.join(phase_names)}")
    if c.freeze_layers and frozen != ["all"] and not set(frozen) <= set(phase_names):
        raise SystemExit(f"freeze_phase={c.freeze_phase!r}: write 'all' or phase names, comma-separated, from "
                         f"{', '.join(phase_names)}")
    check_model_config(c)
    check_wandb(c)


def check_phases(specs, phase):
    """The `phases` key: dicts of `phase`'s fields (the Phase class), a length each, unique names. -> the phases."""
    allowed = [f.name for f in fields(phase)]
    for spec in specs:
        if (not isinstance(spec, dict) or not {"name", "objective"} <= set(spec) <= set(allowed)
                or len({"tokens", "steps"} & set(spec)) != 1):
            optional = [a for a in allowed[2:] if a not in ("tokens", "steps")]
            raise SystemExit(f"phases: {spec!r} must be a dict with name, objective and tokens (or steps: one of "
                             f"the two), and any of {', '.join(optional)}")
    names = [spec["name"] for spec in specs]
    if len(set(names)) < len(names) or any(not isinstance(n, str) or "," in n or n == "all" for n in names):
        raise SystemExit(f"phases: names must be unique, without commas, and not 'all': {names}")
    return [phase(**spec) for spec in specs]


def check_phase(p):
    """A phase that means something, or one line saying what does not."""
    numbers = [p.tokens, p.mask_prob, p.warmup_tokens, p.final_lr_frac]
    if (not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers) or p.decay not in (0, 1)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in (p.steps, p.warmup_steps))):
        raise SystemExit(f"phase {p.name!r}: tokens, mask_prob, warmup_tokens and final_lr_frac are numbers, "
                         f"steps and warmup_steps whole numbers, decay is True or False")
    given = ", ".join(f"{k}={getattr(p, k)}" for k in ("tokens", "steps", "warmup_tokens", "warmup_steps")
                      if getattr(p, k) or k == "tokens" and not p.steps)  # the phase's length and warmup as given
    problems = [(p.objective not in ("clm", "mlm"), f"objective={p.objective!r}: choose 'clm' or 'mlm'"),
                (not (p.tokens > 0 or p.steps > 0) or min(p.tokens, p.steps, p.warmup_tokens, p.warmup_steps) < 0,
                 f"{given}: a phase needs a positive length, a warmup of 0 or more"),
                (p.warmup_tokens > 0 and p.warmup_steps > 0, f"{given}: give the warmup in tokens or in steps, "
                 "not both"),
                (p.objective == "mlm" and not 0 < p.mask_prob < 1, f"mask_prob={p.mask_prob}: choose it in (0, 1)"),
                (p.objective == "clm" and p.mask_prob != 0,
                 "mask_prob is for mlm phases: a CLM phase predicts every next token"),
                (p.decay and (p.warmup_tokens or p.warmup_steps), "a decay phase has no warmup: set warmup_tokens "
                 "(or warmup_steps) to 0"),
                (not 0 <= p.final_lr_frac <= 1, f"final_lr_frac={p.final_lr_frac}: choose a fraction in [0, 1]")]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"phase {p.name!r}: {message}")


def check_model_config(c):
    """model_config names ModernBertConfig fields, and from scratch makes a model that hf.check_config passes."""
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
    if c.model_size not in ("base", "large"):
        raise SystemExit(f"model_size={c.model_size!r}: choose 'base' or 'large' (or set model_config)")
    ids = dict.fromkeys(hf.TOKEN_IDS, 0)  # the data's (build_model), checked with its meta.json
    m = (ModernBertConfig.large if c.model_size == "large" else ModernBertConfig)(**{**ids, **c.model_config})
    with user_error():
        hf.check_config(m, "model_config", "fix the config or the --model_config")
    check_seq_len(m, c.seq_len, f"set model_config's max_position_embeddings to {c.seq_len}", "model_config's ")


def check_wandb(c):
    """wandb (an optional dependency) is installed when the run asks for it, so it is known before any compute."""
    if c.wandb_project and importlib.util.find_spec("wandb") is None:
        raise SystemExit(f"wandb_project={c.wandb_project!r} but wandb is not installed: pip install wandb "
                         "(or leave wandb_project empty)")


# -----------------------------------------------------------------------------
# A run's inputs


def check_run(c, steps, world):
    """-> the data's meta.json, once the run `c` (`steps` optimizer steps on `world` processes) can start: its
    data, out_dir, and init_from (unless it resumes from out_dir)."""
    if not c.data_dir:
        raise SystemExit("data_dir is not set: point it at a directory made by `python data.py`")
    meta = shards.load_meta(c.data_dir)
    with user_error():
        train, n = shards.split_tokens(c.data_dir, "train", meta, c.seq_len, c.micro_batch_size, world)
        shards.split_tokens(c.data_dir, "val", meta, c.seq_len, c.micro_batch_size, world)
    if steps * c.global_batch_size > n and int(os.environ.get("RANK", 0)) == 0:
        print(f"note: the schedule reads {steps * c.global_batch_size:,} windows of {c.seq_len} tokens and "
              f"train.bin holds {n:,}: the data repeats ({steps * c.global_batch_size / n:.1f} epochs), each epoch "
              "in a new order", file=sys.stderr)
    tokenizer_files(c.data_dir)  # what each checkpoint copies: refused now, not at the first checkpoint
    check_out_dir(c.out_dir, "out_dir")
    # Resuming, init_from is not read; that this is the run out_dir holds is checked under the hold (Checkpointer).
    resuming = glob.glob(os.path.join(c.out_dir, "ckpt-*"))
    if c.init_from != "scratch" and not resuming:
        check_init_from(c.init_from, meta, c.data_dir, c.seq_len)
    for path in resuming:  # the run's model (any checkpoint of it): a seq_len changed on resume must fit it too
        try:
            config = ModernBertConfig.from_pretrained(path)
        except (OSError, ValueError):
            continue  # a damaged checkpoint: resume warns and skips it
        check_seq_len(config, c.seq_len, "a new out_dir", f"the run in {c.out_dir}'s ")
        break
    return meta


def check_init_from(path, meta=None, data_dir=None, seq_len=None):
    """init_from is a checkpoint directory this process can read, intact (one of ours has a manifest), with the
    data's tokenizer (given the data's meta.json) and positions for seq_len (given it)."""
    if not os.path.isdir(path):
        raise SystemExit(f"init_from={path!r} is neither 'scratch' nor a checkpoint directory "
                         "(edit the path at the top of the config)")
    problem = checkpoint_problem(path, train_state=False) if os.path.isfile(os.path.join(path, MANIFEST)) else None
    if problem:
        raise SystemExit(f"init_from={path} is damaged: {problem}. Copy it again, or use another checkpoint.")
    config = checkpoint_config(path, f"init_from={path}")
    with user_error(f"init_from={path}"):
        open(hf.weights_file(path), "rb").close()
    if seq_len:
        check_seq_len(config, seq_len, f"a checkpoint with {seq_len} positions or more", f"init_from={path}'s ")
    if meta is None:
        return
    fix = f"prepare the data with the checkpoint's tokenizer: python data.py --tokenizer {path}"
    check_vocab(meta["vocab_size"], config, f"the tokenizer of {data_dir}", path, fix)
    tok = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok) and meta.get("tokenizer_sha256") and sha256(tok) != meta["tokenizer_sha256"]:
        raise SystemExit(f"tokenizer mismatch: {tok} differs from the one {data_dir} was prepared with; {fix}")


def check_seq_len(config, seq_len, fix, whose):
    """The model `config` (`whose`, e.g. "init_from=X's ") has positions for seq_len, or one line ending in `fix`."""
    with user_error():
        config.check_positions(seq_len, "seq_len={}", f"use --seq_len={config.max_position_embeddings} or less, or "
                               f"{fix}", whose=whose)


def checkpoint_config(path, where):
    """-> the ModernBertConfig of the checkpoint `path`, or one line, beginning with `where`, that says why not."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{where}: not a checkpoint directory (no config.json); give a run's final/ or ckpt-STEP/, "
                         "or a Hugging Face ModernBERT directory")
    with user_error(where):
        return ModernBertConfig.from_pretrained(path)
