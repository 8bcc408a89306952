"""
Configs as plain Python, parsed and checked: train.py's (also against the run its out_dir holds), and suites.

A dataclass of defaults, overridden by config files (`key = value` lines, run as Python, each seeing the values set
before it) and then by --key=value arguments; a key the dataclass lacks is an error that lists the valid ones.
"""

import ast
import dataclasses
import glob
import importlib.util
import json
import os
import re

import torch

from model import ModernBertConfig
from support import hf, kernels
from support.files import number, read_json, user_error


def parse(cls, argv):
    """An instance of the dataclass `cls` from config files and --key=value arguments, in order."""
    valid, values = {f.name: f for f in dataclasses.fields(cls)}, {}

    def set_key(key, value, where):
        if key not in valid:
            raise SystemExit(f"{where}: unknown config key {key!r}. Valid keys: {', '.join(valid)}")
        values[key] = check_type(key, value, valid[key].type, where)

    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise SystemExit(f"{arg}: write overrides as --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string
            set_key(key, value, arg)
        elif not os.path.isfile(arg):
            raise SystemExit(f"config file {arg!r} not found: give a path like configs/fr_base.py, or --key=value")
        else:  # the file sees the values so far, so an override file can write out_dir = out_dir + "_mlm"
            for key, value in load_file(arg, dataclasses.asdict(cls(**values))).items():
                set_key(key, value, arg)
    return cls(**values)


def load_file(path, scope=None):
    """The names a Python file (a config, a suite) run in `scope` sets: no imports, functions or _private names."""
    scope = dict(scope or {})
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return {k: v for k, v in scope.items() if not k.startswith("_") and not callable(v)
            and type(v).__name__ != "module"}


def check_type(key, value, typ, where):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 10e9 tokens
    if typ is tuple and isinstance(value, list):
        return tuple(value)
    if typ is str and not isinstance(value, str):
        value = str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise SystemExit(f"{where}: {key} must be {typ.__name__}, got {value!r}")
    return value


POSITIVE = ("seq_len", "global_batch_size", "micro_batch_size", "lr", "eps", "log_interval", "eval_interval",
            "eval_windows", "ckpt_interval", "max_ckpts", "dist_timeout_minutes")
NOT_NEGATIVE = ("weight_decay", "ckpt_every_minutes", "keep_every", "peak_tflops", "skip_tokens")
DROPOUTS = ("embedding_dropout", "attention_dropout", "attn_out_dropout", "mlp_dropout")  # probabilities, in [0, 1)


def check_config(c, phase_names, world):
    """Every value of the config in its range, and the names it gives (phases, layers to freeze) exist."""
    bad = ([f"{k}={getattr(c, k)} must be positive" for k in POSITIVE if not getattr(c, k) > 0]
           + [f"{k}={getattr(c, k)} must be 0 or more" for k in NOT_NEGATIVE if getattr(c, k) < 0]
           + [f"{k}={getattr(c, k)} must be in [0, 1)" for k in DROPOUTS if not 0 <= getattr(c, k) < 1])
    if len(c.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in c.betas):
        bad.append(f"betas={c.betas} must be two numbers in [0, 1), e.g. (0.9, 0.98)")
    if bad:
        raise SystemExit(f"{'; '.join(bad)}: fix the config or the --key=value")
    if c.global_batch_size % (c.micro_batch_size * world):
        fits = [m for m in range(c.micro_batch_size, 0, -1) if c.global_batch_size % (m * world) == 0]
        fix = f"e.g. --micro_batch_size={fits[0]}" if fits else f"a global_batch_size that {world} ranks share"
        raise SystemExit(f"global_batch_size={c.global_batch_size} is not a multiple of micro_batch_size="
                         f"{c.micro_batch_size} x world size {world}: every rank needs whole micro batches; {fix}")
    run, frozen = c.run_phases.split(","), c.freeze_phase.split(",")
    if run != ["all"] and not any(phase_names[i:i + len(run)] == run for i in range(len(phase_names))):
        raise SystemExit(f"run_phases={c.run_phases!r}: write 'all' or consecutive phase names in order, "
                         f"comma-separated, from {', '.join(phase_names)}")
    if c.freeze_layers and frozen != ["all"] and not set(frozen) <= set(phase_names):
        raise SystemExit(f"freeze_phase={c.freeze_phase!r}: write 'all' or phase names, comma-separated, from "
                         f"{', '.join(phase_names)}")
    if c.freeze_mode not in ("exact", "zero_grad"):
        raise SystemExit(f"freeze_mode={c.freeze_mode!r}: choose exact or zero_grad")
    frozen_layers(c.freeze_layers)
    with user_error():  # the names; whether each runs where the model is placed is said there
        kernels.choose(c.attn_backend, torch.device("cpu"), torch.float32, 0.0)
        kernels.compiler(c.compile, torch.device("cpu"))
    check_model_config(c)
    if c.wandb_project and importlib.util.find_spec("wandb") is None:  # optional: said before any compute
        raise SystemExit(f"wandb_project={c.wandb_project!r} but wandb is not installed: pip install wandb "
                         "(or leave wandb_project empty)")


def frozen_layers(spec):
    """freeze_layers ("0-7,10") -> the layer numbers; a spec of another form is one line."""
    layers = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        if not (m := re.fullmatch(r"(\d+)(?:-(\d+))?", part)):
            raise SystemExit(f"freeze_layers={spec!r}: write layer ranges like '0-7' or '8-14,20'")
        layers.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return layers


def check_phases(specs, phase):
    """The `phases` key: dicts of `phase`'s fields (the Phase class), a length each, unique names. -> the phases."""
    allowed = [f.name for f in dataclasses.fields(phase)]
    for spec in specs:
        if (not isinstance(spec, dict) or not {"name", "objective"} <= set(spec) <= set(allowed)
                or len({"tokens", "steps"} & set(spec)) != 1):
            raise SystemExit(f"phases: {spec!r} must be a dict with name, objective and tokens (or steps: one of the "
                             f"two), and any of {', '.join(a for a in allowed[2:] if a not in ('tokens', 'steps'))}")
    names = [spec["name"] for spec in specs]
    if len(set(names)) < len(names) or any(not isinstance(n, str) or "," in n or n == "all" for n in names):
        raise SystemExit(f"phases: names must be unique, without commas, and not 'all': {names}")
    return [phase(**spec) for spec in specs]


def check_phase(p):
    """A phase that means something, or one line saying what does not."""
    if not (all(map(number, (p.tokens, p.mask_prob, p.warmup_tokens, p.final_lr_frac))) and p.decay in (0, 1)
            and all(type(x) is int for x in (p.steps, p.warmup_steps))):
        raise SystemExit(f"phase {p.name!r}: tokens, mask_prob, warmup_tokens and final_lr_frac are numbers, "
                         f"steps and warmup_steps whole numbers, decay is True or False")
    given = ", ".join(f"{k}={getattr(p, k)}" for k in ("tokens", "steps", "warmup_tokens", "warmup_steps")
                      if getattr(p, k) or k == "tokens" and not p.steps)  # the phase's length and warmup as given
    problems = [(p.objective not in ("clm", "mlm"), f"objective={p.objective!r}: choose 'clm' or 'mlm'"),
                (not (p.tokens > 0 or p.steps > 0) or min(p.tokens, p.steps, p.warmup_tokens, p.warmup_steps) < 0,
                 f"{given}: a phase needs a positive length, a warmup of 0 or more"),
                (p.warmup_tokens > 0 and p.warmup_steps > 0, f"{given}: give the warmup in tokens or steps, not both"),
                (p.objective == "mlm" and not 0 < p.mask_prob < 1, f"mask_prob={p.mask_prob}: choose it in (0, 1)"),
                (p.objective == "clm" and p.mask_prob != 0,
                 "mask_prob is for mlm phases: a CLM phase predicts every next token"),
                (p.decay and (p.warmup_tokens or p.warmup_steps), "a decay phase has no warmup: set warmup_tokens "
                 "(or warmup_steps) to 0"),
                (not 0 <= p.final_lr_frac <= 1, f"final_lr_frac={p.final_lr_frac}: choose a fraction in [0, 1]")]
    if message := next((message for bad, message in problems if bad), None):
        raise SystemExit(f"phase {p.name!r}: {message}")


def check_model_config(c):
    """model_config names ModernBertConfig fields, and from scratch makes a model that hf.check_config passes."""
    keys = [f.name for f in dataclasses.fields(ModernBertConfig)]
    if unknown := sorted(set(c.model_config) - set(keys)):
        raise SystemExit(f"model_config: unknown key(s) {', '.join(unknown)}; ModernBertConfig has {', '.join(keys)}")
    if c.init_from != "scratch":
        return  # the checkpoint brings its own
    if c.model_size not in ("base", "large"):
        raise SystemExit(f"model_size={c.model_size!r}: choose 'base' or 'large' (or set model_config)")
    ids = dict.fromkeys(hf.TOKEN_IDS, 0)  # the data's (build_model), checked with its meta.json
    m = (ModernBertConfig.large if c.model_size == "large" else ModernBertConfig)(**{**ids, **c.model_config})
    with user_error():
        hf.check_config(m, "model_config", "fix the config or the --model_config")
    check_seq_len(m, c.seq_len, f"set model_config's max_position_embeddings to {c.seq_len}", "model_config's ")


def check_seq_len(config, seq_len, fix, whose):
    """The model `config` (`whose`, e.g. "init_from=X's ") has positions for seq_len, or one line ending in `fix`."""
    with user_error():
        config.check_positions(seq_len, "seq_len={}", f"use --seq_len={config.max_position_embeddings} or less, or "
                               f"{fix}", whose=whose)


# The keys train.py builds the paper's two phases from: a `phases` list replaces them, so the config a run with
# phases shows (config.json, the start-up dump, W&B) leaves them out.
PAPER_PHASE_KEYS = ("objective", "mask_prob", "tokens", "warmup_tokens", "decay_frac", "decay_mask_prob",
                    "final_lr_frac")


def run_config(c):
    """The config `c` as the run uses it, as JSON has it (tuples as lists): without the keys its phases replace."""
    return {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(c))).items()
            if not (c.phases and k in PAPER_PHASE_KEYS)}


# Settings that do not change what a run computes, which a resumed run may change. Every other key (the objective
# and phases, seq_len, the data, the model, the seeds, ...) must stay as it was, unless resume_changes names it.
RUN_SETTINGS = {"out_dir", "run_phases", "resume_changes", "skip_tokens", "device", "dtype", "compile", "attn_backend",
                "peak_tflops", "micro_batch_size", "log_interval", "eval_interval", "eval_windows",
                "ckpt_interval", "ckpt_every_minutes", "max_ckpts", "keep_every", "dist_timeout_minutes",
                "wandb_project", "wandb_run_name"}


def check_same_run(c):
    """A run resumed from out_dir (one with checkpoints) is the run its config.json describes: a config that changes
    it is refused. Run under the hold on out_dir, so that the checkpoints it sees are those the run resumes."""
    path = os.path.join(c.out_dir, "config.json")
    if not glob.glob(os.path.join(c.out_dir, "ckpt-*")) or not os.path.lexists(path):
        return
    try:
        old = read_json(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: it says which run {c.out_dir} holds. Put it back (each checkpoint's train_state.pt "
                         "holds the run's config), or choose a new out_dir") from None
    new = run_config(c)
    keep = RUN_SETTINGS | {k.strip() for k in c.resume_changes.split(",")}
    if changed := [k for k in new if k in old and k not in keep and old[k] != new[k]]:
        raise SystemExit(f"{c.out_dir} holds a run with other settings: "
                         f"{'; '.join(d for k in changed for d in differences(k, old[k], new[k]))}. Resuming would "
                         f"change what the run is: choose a new out_dir, or, if the change is deliberate, "
                         f"--resume_changes={','.join(changed)}")


class Unset:
    def __repr__(self):
        return "(unset)"


def differences(key, old, new):
    """Where two values of a config key differ, down to the entry: ["phases[1].steps 29500 -> 30000"]."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in {**old, **new} for d in differences(f"{key}.{k}", old.get(k, Unset()), new.get(k, Unset()))]
    if isinstance(old, list) and isinstance(new, list):
        inner = [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(f"{key}[{i}]", a, b)]
        return inner + ([f"{key}: {len(old)} entries -> {len(new)}"] if len(old) != len(new) else [])
    return [] if old == new else [f"{key} {old!r} -> {new!r}"]
