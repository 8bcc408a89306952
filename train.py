"""
Continued pretraining of ModernBERT with the CLM detour (or its MLM twin).

    python train.py configs/demo.py                               # one process, CPU or one GPU
    torchrun --nproc_per_node=4 train.py configs/fr_base.py       # DDP
    python train.py configs/fr_base.py configs/mlm_baseline.py --lr=1e-4

Phase 1 ("main") trains with `objective`: "clm" = causal mask + next-token loss
on every position; "mlm" = bidirectional mask + masked-token loss. Phase 2
("decay") is always bidirectional MLM at decay_mask_prob with a 1-sqrt lr
decay. The model, the head and the optimizer state are the same throughout;
only the attention mask, the targets and the lr schedule change.

Re-running the same command with an existing out_dir resumes from its latest
checkpoint, exactly.
"""

import ast
import dataclasses
import glob
import json
import math
import os
import re
import resource
import shutil
from contextlib import nullcontext
import sys
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import distributed
from data import SPECIAL_NAMES, Loader, clm_batch, load_meta, mlm_batch
from model import ModernBertConfig, ModernBertForMaskedLM, load_config, peak_flops, training_flops

# -----------------------------------------------------------------------------
# Defaults. A config file (plain Python, `key = value` lines) or --key=value
# overrides any of them; anything else is an error.


@dataclass
class Config:
    out_dir: str = "out"  # checkpoints, metrics.jsonl, config.json; re-running resumes from here
    data_dir: str = ""  # a directory made by `python data.py prepare`
    init_from: str = "scratch"  # "scratch", a Hugging Face ModernBERT directory, or one of our checkpoints
    model_size: str = "base"  # for scratch: "base" or "large"
    model_config: dict = dataclasses.field(default_factory=dict)  # for scratch: ModernBertConfig overrides
    # the objective: THE flag of the method
    objective: str = "clm"  # phase 1: "clm" (causal, next token) or "mlm" (bidirectional, masked tokens)
    mask_prob: float = 0.3  # phase-1 masking when objective == "mlm"
    split_docs: bool = False  # restart attention and positions at each document (the paper does not)
    # budget and schedule
    tokens: int = 10_000_000_000  # phase-1 token budget
    warmup_tokens: int = 100_000_000  # linear warmup at the start of phase 1
    lr: float = 2e-4  # peak
    decay_frac: float = 0.1  # decay length as a fraction of `tokens`; 0 disables the decay
    decay_mask_prob: float = 0.15
    final_lr_frac: float = 0.1  # the decay ends at final_lr_frac * lr
    phase: str = "all"  # "all", "main" (phase 1 only) or "decay" (phase 2 only, from a phase-1 checkpoint)
    # decoupled AdamW
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 1e-5  # decoupled: p <- p * (1 - weight_decay * lr_t / lr)
    # freezing: these layers get no update at all (bit-identical) during freeze_phase
    freeze_layers: str = ""  # e.g. "0-7" or "8-14,20"; empty for none
    freeze_phase: str = "main"  # "main", "decay" or "both"
    # batch
    seq_len: int = 8192
    global_batch_size: int = 384  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 4  # sequences per forward on one rank
    # dropout (ModernBERT's pretraining: 0.1 after the attention output projection only)
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_out_dropout: float = 0.1
    mlp_dropout: float = 0.0
    # seeds
    seed: int = 17  # init, masking, dropout
    data_seed: int = 42  # data order only
    # system
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" (bfloat16 autocast on GPU, float32 on CPU), "float32", "bfloat16"
    compile: bool = False
    attn_backend: str = "auto"  # "auto", "flash", "varlen", "sdpa"
    # logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 500  # also at the end of each phase
    eval_windows: int = 64  # val windows per evaluation (all of val.bin if fewer)
    ckpt_interval: int = 1000
    max_ckpts: int = 3


def parse_config(argv):
    """Config files (plain Python) then --key=value, with type checking."""
    valid = {f.name: f for f in fields(Config)}
    values = {}

    def set_key(key, value, where):
        if key not in valid:
            raise SystemExit(f"{where}: unknown config key {key!r}. Valid keys: {', '.join(valid)}")
        values[key] = _check_type(key, value, valid[key].type, where)

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
        else:
            if not os.path.isfile(arg):
                raise SystemExit(f"config file {arg!r} not found")
            # The file sees the values so far, so an override file can write out_dir = out_dir + "_mlm".
            scope = {**dataclasses.asdict(Config(**values))}
            exec(compile(open(arg).read(), arg, "exec"), scope)
            for key, value in scope.items():
                if not key.startswith("_") and not callable(value) and type(value).__name__ != "module":
                    set_key(key, value, arg)
    return Config(**values)


def _check_type(key, value, typ, where):
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


def layer_set(spec, n_layers):
    """ "0-7,10" -> {0, ..., 7, 10}"""
    layers = set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SystemExit(f"freeze_layers={spec!r}: write layer ranges like '0-7' or '8-14,20'")
        lo, hi = int(m[1]), int(m[2] or m[1])
        layers.update(range(lo, hi + 1))
    if layers and max(layers) >= n_layers:
        raise SystemExit(f"freeze_layers={spec!r}: the model has layers 0-{n_layers - 1}")
    return layers


# -----------------------------------------------------------------------------
# Phases and the lr schedule. Steps 0 .. main_steps-1 are phase 1; the next
# decay_steps are the decay. `phase` only picks which of those steps this run does.


@dataclass
class Schedule:
    main_steps: int
    decay_steps: int
    warmup_steps: int
    lr: float
    final_lr_frac: float

    @classmethod
    def from_config(cls, c):
        tokens_per_step = c.global_batch_size * c.seq_len
        return cls(main_steps=math.ceil(c.tokens / tokens_per_step),
                   decay_steps=math.ceil(c.decay_frac * c.tokens / tokens_per_step),
                   warmup_steps=math.ceil(c.warmup_tokens / tokens_per_step), lr=c.lr, final_lr_frac=c.final_lr_frac)

    def phase(self, step):
        return "main" if step < self.main_steps else "decay"

    def lr_at(self, step):
        """Phase 1: linear warmup, then constant. Decay: no warmup, 1-sqrt from lr to final_lr_frac * lr."""
        if step < self.main_steps:
            return self.lr * min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps else self.lr
        t = (step - self.main_steps) / self.decay_steps
        return self.lr * (self.final_lr_frac + (1 - self.final_lr_frac) * (1 - math.sqrt(t)))


# -----------------------------------------------------------------------------
# The loss: one function for both objectives. The head runs only on the rows
# that have a target; the sum is divided by the number of targets in the whole
# global batch, so every target weighs the same whatever the micro batch or world size.


def loss_sum(model, batch, causal):
    """Sum of cross-entropies over the batch's targets, in float32."""
    logits = model(batch.tokens, causal=causal, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                   rows=batch.rows)
    return F.cross_entropy(logits.float(), batch.targets, reduction="sum")


def make_batch(windows, objective, mask_prob, meta, seed, split_docs):
    if objective == "clm":
        return clm_batch(windows, meta["eos_id"], split_docs)
    return mlm_batch(windows, mask_prob, {k: meta[k] for k in SPECIAL_NAMES}, meta["vocab_size"], seed, split_docs)


# -----------------------------------------------------------------------------
# Model, optimizer, freezing


def build_model(c, meta, path):
    """From scratch (path "scratch"), or from a checkpoint directory: Hugging Face ModernBERT or ours.
    Dropout and the attention backend come from the training config, not the checkpoint."""
    dropout = dict(embedding_dropout=c.embedding_dropout, attention_dropout=c.attention_dropout,
                   attn_out_dropout=c.attn_out_dropout, mlp_dropout=c.mlp_dropout, attn_backend=c.attn_backend)
    if path == "scratch":
        preset = {"base": ModernBertConfig.base, "large": ModernBertConfig.large}.get(c.model_size)
        if preset is None:
            raise SystemExit(f"model_size={c.model_size!r}: choose 'base' or 'large' (or set model_config)")
        vocab = 64 * math.ceil(meta["vocab_size"] / 64)  # a multiple of 64 for fast matmuls
        ids = dict(pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
                   bos_token_id=meta["cls_id"], eos_token_id=meta["sep_id"])
        torch.manual_seed(c.seed)
        return ModernBertForMaskedLM(preset(**{"vocab_size": vocab, **ids, **c.model_config, **dropout}))
    if not os.path.isdir(path):
        raise SystemExit(f"init_from={path!r} is neither 'scratch' nor a checkpoint directory "
                         "(edit the path at the top of the config)")
    check_tokenizer(path, load_config(path), meta, c.data_dir)
    return ModernBertForMaskedLM.from_pretrained(path, **dropout)


def check_tokenizer(ckpt, config, meta, data_dir):
    """The data must be tokenized with the checkpoint's tokenizer."""
    fix = "prepare the data with the checkpoint's tokenizer: python data.py prepare --tokenizer " + ckpt
    if meta["vocab_size"] > config.vocab_size:
        raise SystemExit(f"vocab mismatch: {data_dir} was tokenized with a vocabulary of {meta['vocab_size']} but "
                         f"{ckpt} has {config.vocab_size} embeddings; {fix}")
    tok_file = os.path.join(ckpt, "tokenizer.json")
    if os.path.isfile(tok_file) and meta.get("tokenizer_sha256"):
        import hashlib
        if hashlib.sha256(open(tok_file, "rb").read()).hexdigest() != meta["tokenizer_sha256"]:
            raise SystemExit(f"tokenizer mismatch: {ckpt}/tokenizer.json differs from the one {data_dir} was "
                             f"prepared with; {fix}")


def make_optimizer(model, c, device):
    """Decoupled AdamW. torch's AdamW decays p <- p * (1 - lr_t * wd); with wd = weight_decay / lr
    that is exactly p <- p * (1 - weight_decay * lr_t / lr), the ModernBERT/Composer form.
    No decay on biases and norm weights (the 1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay / c.lr},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=c.lr, betas=c.betas, eps=c.eps, **fast)


def frozen_params(model, layers):
    return [p for i in sorted(layers) for p in model.model.layers[i].parameters()]


# -----------------------------------------------------------------------------
# Checkpoints: out_dir/ckpt-STEP/ = Hugging Face files + train_state.pt, written
# to a temporary directory and renamed, so a kill never leaves a half checkpoint.


def save_checkpoint(path, model, optimizer, state, meta, c):
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = os.path.join(c.data_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(tmp, name))
    torch.save({**state, "optimizer": optimizer.state_dict(), "config": dataclasses.asdict(c)},
               os.path.join(tmp, "train_state.pt"))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def checkpoints(out_dir):
    """Our complete checkpoints in out_dir, oldest first."""
    found = glob.glob(os.path.join(out_dir, "ckpt-*", "train_state.pt"))
    return sorted((os.path.dirname(p) for p in found), key=lambda p: int(p.rsplit("-", 1)[1]))



# -----------------------------------------------------------------------------
# Evaluation: MLM loss at 15% and CLM loss on val.bin, with a fixed mask seed,
# for both arms alike so runs with different objectives compare.


@torch.no_grad()
def evaluate(model, c, meta, rank, world, device, autocast):
    model.eval()
    val = Loader(c.data_dir, "val", c.seq_len, c.micro_batch_size, c.data_seed, rank, world)
    n_steps = max(1, min(c.eval_windows, val.n_windows) // (c.micro_batch_size * world))
    totals = torch.zeros(4, device=device, dtype=torch.float64)  # mlm sum, mlm count, clm sum, clm count
    for k in range(n_steps):
        windows = val.next()
        for j, (objective, p) in enumerate([("mlm", 0.15), ("clm", 0.0)]):
            batch = make_batch(windows, objective, p, meta, [0, k * world + rank], c.split_docs).to(device)
            with autocast:
                totals[2 * j] += loss_sum(model, batch, causal=objective == "clm")
            totals[2 * j + 1] += batch.targets.numel()
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    return {"val_mlm_loss": (totals[0] / totals[1]).item(), "val_clm_loss": (totals[2] / totals[3]).item()}


# -----------------------------------------------------------------------------
# Training


def main(argv):
    c = parse_config(argv)
    for key, allowed in [("objective", ("clm", "mlm")), ("phase", ("all", "main", "decay")),
                         ("freeze_phase", ("main", "decay", "both"))]:
        if getattr(c, key) not in allowed:
            raise SystemExit(f"{key}={getattr(c, key)!r}: choose one of {', '.join(allowed)}")
    if not c.data_dir:
        raise SystemExit("data_dir is not set: point it at a directory made by `python data.py prepare`")
    meta = load_meta(c.data_dir)

    rank, world, device = distributed.setup(c.device)  # the same without torchrun: one process
    ddp, master = world > 1, rank == 0
    if c.global_batch_size % (c.micro_batch_size * world):
        raise SystemExit(f"global_batch_size={c.global_batch_size} is not a multiple of micro_batch_size="
                         f"{c.micro_batch_size} x world size {world}")
    accum = c.global_batch_size // (c.micro_batch_size * world)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[c.dtype]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    # Resume from our latest checkpoint in out_dir or, for phase="decay", from the phase-1
    # checkpoint named by init_from (weights, optimizer, step, data position, RNG).
    resume_from = (checkpoints(c.out_dir) or [None])[-1]
    if resume_from is None and c.phase == "decay" and os.path.isfile(os.path.join(c.init_from, "train_state.pt")):
        resume_from = c.init_from
    model = build_model(c, meta, resume_from or c.init_from).to(device)
    sched = Schedule.from_config(c)
    frozen = layer_set(c.freeze_layers, model.config.num_hidden_layers)
    optimizer = make_optimizer(model, c, device)
    loader = Loader(c.data_dir, "train", c.seq_len, c.micro_batch_size, c.data_seed, rank, world)
    step, tokens_seen = 0, 0
    torch.manual_seed(c.seed + rank)  # dropout
    if resume_from:
        state = torch.load(os.path.join(resume_from, "train_state.pt"), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # a global position: any world size continues from it
        step, tokens_seen = state["step"], state["tokens"]
        if len(state["rng"]) == world:  # the same world size: every rank's dropout stream continues exactly
            torch.set_rng_state(state["rng"][rank])
    first, last = {"all": (0, sched.main_steps + sched.decay_steps), "main": (0, sched.main_steps),
                   "decay": (sched.main_steps, sched.main_steps + sched.decay_steps)}[c.phase]
    if c.phase == "decay" and step < first:
        if step > 0:
            raise SystemExit(f"phase='decay' needs a checkpoint from the end of phase 1 (step {first}); "
                             f"{resume_from} is at step {step}")
        step = first  # a checkpoint without optimizer state: the decay starts fresh
    step = max(step, first)

    if master:
        os.makedirs(c.out_dir, exist_ok=True)
        with open(os.path.join(c.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(c), f, indent=2)
        print(json.dumps(dataclasses.asdict(c), indent=2))
        n = model.num_params()
        print(f"model: {n / 1e6:.2f}M parameters, {model.config.num_hidden_layers} layers; world {world}, "
              f"accumulation {accum}; {sched.main_steps} main + {sched.decay_steps} decay steps of "
              f"{c.global_batch_size * c.seq_len:,} tokens" + (f"; resuming at step {step}" if resume_from else ""))
        metrics_path = os.path.join(c.out_dir, "metrics.jsonl")
        if os.path.isfile(metrics_path):  # drop what a killed run logged after its last checkpoint
            with open(metrics_path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= step]
            with open(metrics_path, "w") as f:
                f.writelines(kept)

    raw_model = model
    if c.compile:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def checkpoint(path):
        rng = [torch.get_rng_state()]
        if ddp:
            rng = [None] * world
            dist.all_gather_object(rng, torch.get_rng_state())
        if master:
            state = dict(step=step, tokens=tokens_seen, loader=loader.state_dict(), rng=rng, world_size=world)
            save_checkpoint(path, raw_model, optimizer, state, meta, c)
            for old in checkpoints(c.out_dir)[:-c.max_ckpts]:
                shutil.rmtree(old)
        if ddp:
            dist.barrier()

    def log(record):
        if master:
            with open(os.path.join(c.out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    peak = peak_flops(device)
    bar = tqdm(total=last - first, initial=step - first, desc=c.phase, disable=not master or None, unit="step")
    t0, timed_steps, timed_tokens, loss_acc = time.time(), 0, 0, torch.zeros((), device=device)
    while step < last:
        phase = sched.phase(step)
        objective, mask_prob = (c.objective, c.mask_prob) if phase == "main" else ("mlm", c.decay_mask_prob)
        lr = sched.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        freeze = frozen if c.freeze_phase in (phase, "both") else set()

        # The whole step's micro batches first: the loss divides by the global number of targets.
        batches = [make_batch(loader.next(), objective, mask_prob, meta, [c.seed, step, k * world + rank],
                              c.split_docs) for k in range(accum)]
        n_targets = torch.tensor(float(sum(b.targets.numel() for b in batches)), device=device)
        if ddp:
            dist.all_reduce(n_targets)
        for k, batch in enumerate(batches):
            batch = batch.to(device, non_blocking=True)
            sync = not ddp or k == accum - 1
            with (model.no_sync() if not sync else nullcontext()), autocast:
                loss = loss_sum(model, batch, causal=objective == "clm") * world / n_targets  # DDP averages ranks
            loss.backward()
            loss_acc += loss.detach() / world
        for p in frozen_params(raw_model, freeze):
            p.grad = None  # AdamW skips a parameter with no gradient: no decay, no moment update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += c.global_batch_size * c.seq_len
        timed_steps += 1
        timed_tokens += c.global_batch_size * c.seq_len
        bar.update(1)

        # Log (and check the loss) at every log interval, phase end and checkpoint: a checkpoint
        # is only written after its loss was seen finite, and the logged loss averages restart
        # there, so a resumed run logs exactly what an uninterrupted one does.
        end_of_phase = step == last or sched.phase(step) != phase
        save = step % c.ckpt_interval == 0 or end_of_phase
        if step % c.log_interval == 0 or save:
            if ddp:
                dist.all_reduce(loss_acc)
            loss_value = loss_acc.item() / timed_steps
            if not math.isfinite(loss_value):
                raise SystemExit(f"step {step}: loss is {loss_value}; stopping. The last good checkpoint is "
                                 f"{(checkpoints(c.out_dir) or ['(none)'])[-1]}; lower lr or check the data.")
            dt = time.time() - t0
            tok_s = timed_tokens / dt
            record = dict(step=step, phase=phase, objective=objective, tokens=tokens_seen, loss=loss_value,
                          lr=lr, tokens_per_s=tok_s)
            if peak:
                flops = training_flops(raw_model.config, c.global_batch_size * c.seq_len, c.seq_len,
                                       objective == "clm", n_targets.item())
                record["mfu"] = flops * timed_steps / dt / world / peak
            if step % c.eval_interval == 0 or end_of_phase:
                record.update(evaluate(raw_model, c, meta, rank, world, device, autocast))
            log(record)
            if master:
                eta = (last - step) * dt / timed_steps
                extra = "".join(f" {k} {record[k]:.4f}" for k in ("val_mlm_loss", "val_clm_loss") if k in record)
                mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
                bar.write(f"{phase} {objective} step {step}/{last} loss {loss_value:.4f} lr {lr:.2e} "
                          f"{tok_s:,.0f} tok/s{mfu}{extra} eta {eta / 60:.1f} min")
            t0, timed_steps, timed_tokens, loss_acc = time.time(), 0, 0, torch.zeros((), device=device)
        if save:
            checkpoint(os.path.join(c.out_dir, f"ckpt-{step}"))
    bar.close()
    checkpoint(os.path.join(c.out_dir, "final"))
    if master:
        mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        print(f"done: {c.out_dir}/final (step {step}, {tokens_seen:,} tokens); peak memory {mem / 2 ** 30:.2f} GiB")
    distributed.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
