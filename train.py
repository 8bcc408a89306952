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
valid checkpoint, exactly. SIGTERM or SIGINT (a cluster's preemption, Ctrl-C)
finishes the step, writes a checkpoint and exits with 128 + the signal number
(143 for SIGTERM), so a scheduler can requeue the same command.
"""

import ast
import dataclasses
import glob
import json
import math
import os
import queue
import re
import resource
import shutil
import signal
import socket
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from support import distributed
from support.checkpoint import (MANIFEST, checkpoint_problem, latest_valid_checkpoint, rng_state, save_checkpoint,
                        set_rng_state, sha256, step_checkpoints, trim_metrics)
from data import Loader, clm_batch, load_meta, mlm_batch
from model import ModernBertConfig, ModernBertForMaskedLM, load_config, peak_flops, training_flops
from support.tokenizer import SPECIAL_NAMES

# -----------------------------------------------------------------------------
# Defaults. A config file (plain Python, `key = value` lines) or --key=value
# overrides any of them; anything else is an error.


@dataclass
class Config:
    out_dir: str = "out"  # checkpoints, metrics.jsonl, config.json; re-running resumes from here
    data_dir: str = ""  # a directory made by `python data.py`
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
    compile: str = "auto"  # "auto": on for CUDA, off on CPU (where inductor compiles for minutes); True or False
    attn_backend: str = "auto"  # "auto", "flash", "varlen", "sdpa"
    peak_tflops: float = 0.0  # the GPU's dense bf16 peak for MFU; 0: known from its name (model.PEAK_FLOPS)
    # logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 500  # also at the end of each phase
    eval_windows: int = 64  # val windows per evaluation (all of val.bin if fewer)
    ckpt_interval: int = 1000
    ckpt_every_minutes: float = 60.0  # also checkpoint when this long has passed since the last one; 0: off
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
    c = Config(**values)
    for key, allowed in [("objective", ("clm", "mlm")), ("phase", ("all", "main", "decay")),
                         ("freeze_phase", ("main", "decay", "both"))]:
        if getattr(c, key) not in allowed:
            raise SystemExit(f"{key}={getattr(c, key)!r}: choose one of {', '.join(allowed)}")
    if c.compile.lower() not in ("auto", "true", "false"):
        raise SystemExit(f"compile={c.compile!r}: choose auto, True or False")
    return c


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
    main_objective: tuple  # (objective, mask_prob) of phase 1; the decay is ("mlm", decay_mask_prob)
    decay_objective: tuple

    @classmethod
    def from_config(cls, c):
        tokens_per_step = c.global_batch_size * c.seq_len
        return cls(main_steps=math.ceil(c.tokens / tokens_per_step),
                   decay_steps=math.ceil(c.decay_frac * c.tokens / tokens_per_step),
                   warmup_steps=math.ceil(c.warmup_tokens / tokens_per_step), lr=c.lr, final_lr_frac=c.final_lr_frac,
                   main_objective=(c.objective, c.mask_prob), decay_objective=("mlm", c.decay_mask_prob))

    def phase(self, step):
        return "main" if step < self.main_steps else "decay"

    def objective(self, step):
        """(objective, mask_prob) of a step: phase 1 has the config's objective, the decay MLM."""
        return self.main_objective if step < self.main_steps else self.decay_objective

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
    """Sum of cross-entropies over the batch's targets, in float32. The model computes it in chunks of
    rows (model.ChunkedCrossEntropy), never holding (rows, vocab) logits; through forward, so DDP's
    gradient hooks see the call."""
    return model(batch.tokens, causal=causal, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                 rows=batch.rows, targets=batch.targets)


def wrap(model, compiled, ddp, device):
    """The model the steps call. Compiled: one graph for the whole forward, loss included (no graph break),
    and one more when causal flips at the phase boundary; the MLM row count is marked dynamic (backward).
    DDP wraps the compiled model, so its gradient all-reduce follows the whole backward instead of
    overlapping it: a few ms once per optimizer step, against seconds of accumulated micro batches."""
    if compiled:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def backward(model, batches, causal, n_targets, world, device, autocast, compiled):
    """Sum the micro batches' gradients into .grad, each loss divided by the global number of targets;
    return this rank's share of the step's loss. DDP all-reduces the gradients after the last one."""
    total = 0.0
    for k, batch in enumerate(batches):
        batch = batch.to(device, non_blocking=True)
        if compiled:  # the number of MLM targets changes every step: one graph for all of them
            torch._dynamo.mark_dynamic(batch.rows, 0)
            torch._dynamo.mark_dynamic(batch.targets, 0)
        last = k == len(batches) - 1
        with (model.no_sync() if world > 1 and not last else nullcontext()), autocast:
            loss = loss_sum(model, batch, causal) * world / n_targets  # * world: DDP averages the ranks
        loss.backward()
        total = total + loss.detach() / world
    return total


def make_batch(windows, objective, mask_prob, meta, seed, split_docs):
    if objective == "clm":
        return clm_batch(windows, meta["eos_id"], split_docs)
    return mlm_batch(windows, mask_prob, {k: meta[k] for k in SPECIAL_NAMES}, meta["vocab_size"], seed, split_docs)


def prefetch(produce, steps, depth=2):
    """Yield produce(step) for each of `steps`, built up to `depth` steps ahead by a background thread,
    so that the CPU work of a step's batches (reading, masking, targets, pinning) overlaps the GPU work
    of the steps before. produce() runs in step order in one thread: the stream is what it would be
    without the thread, and an exception in it is raised here, at the step it belongs to."""
    ready, done = queue.Queue(maxsize=depth), threading.Event()

    def work():
        for step in steps:
            try:
                item = (produce(step), None)
            except BaseException as e:  # noqa: BLE001 (raised again in the consumer)
                item = (None, e)
            while not done.is_set():  # a consumer that stopped (signal, error) reads no more
                try:
                    ready.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if item[1] is not None or done.is_set():
                return

    threading.Thread(target=work, daemon=True, name="prefetch").start()
    try:
        for _ in steps:
            item, error = ready.get()
            if error is not None:
                raise error
            yield item
    finally:
        done.set()


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
    check_tokenizer(path, load_config(path), meta, c.data_dir)
    try:
        return ModernBertForMaskedLM.from_pretrained(path, **dropout)
    except (SafetensorError, RuntimeError) as e:  # what a truncated weights file raises, without its name
        weights = [f for f in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, f))]
        raise SystemExit(f"cannot load {os.path.join(path, weights[0])} ({e}): is the file complete? Copy it again.")


def check_init_from(path):
    """init_from must exist; one of our checkpoints (it has a manifest) must also be intact."""
    if not os.path.isdir(path):
        raise SystemExit(f"init_from={path!r} is neither 'scratch' nor a checkpoint directory "
                         "(edit the path at the top of the config)")
    problem = checkpoint_problem(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
    if problem:
        raise SystemExit(f"init_from={path} is damaged: {problem}. Copy it again, or use another checkpoint.")


def check_tokenizer(ckpt, config, meta, data_dir):
    """The data must be tokenized with the checkpoint's tokenizer."""
    fix = "prepare the data with the checkpoint's tokenizer: python data.py --tokenizer " + ckpt
    if meta["vocab_size"] > config.vocab_size:
        raise SystemExit(f"vocab mismatch: {data_dir} was tokenized with a vocabulary of {meta['vocab_size']} but "
                         f"{ckpt} has {config.vocab_size} embeddings; {fix}")
    tok_file = os.path.join(ckpt, "tokenizer.json")
    if os.path.isfile(tok_file) and meta.get("tokenizer_sha256"):
        if sha256(tok_file) != meta["tokenizer_sha256"]:
            raise SystemExit(f"tokenizer mismatch: {ckpt}/tokenizer.json differs from the one {data_dir} was "
                             f"prepared with; {fix}")


def make_optimizer(model, c, device):
    """Decoupled AdamW. torch's AdamW decays p <- p * (1 - lr_t * wd); with wd = weight_decay / lr
    that is exactly p <- p * (1 - weight_decay * lr_t / lr), the ModernBERT/Composer form.
    No decay on biases and norm weights (the 1-D parameters)."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(model.param_groups(c.weight_decay / c.lr), lr=c.lr, betas=c.betas, eps=c.eps, **fast)


def layer_params(model, layers):
    return [p for i in sorted(layers) for p in model.model.layers[i].parameters()]


# Rank 0 alone decides some things (which checkpoint to resume, writing one). Every rank gets the
# outcome, errors included, so no rank is left waiting in a collective for one that stopped.

def on_rank0(fn, rank, ddp):
    """fn() on rank 0; its result, or the SystemExit it raised, on every rank."""
    result = None
    if rank == 0:
        try:
            result = fn()
        except SystemExit as e:
            result = e
    if ddp:
        box = [result]
        dist.broadcast_object_list(box)
        result = box[0]
    if isinstance(result, SystemExit):
        raise result
    return result


def every_rank_sees(path, world):
    """Checkpoints are written by rank 0 and read by every rank on resume: a node that cannot see them would
    resume from another step than the others. Each rank checks `path` (sizes only, cheap); all agree or stop."""
    views = [None] * world
    dist.all_gather_object(views, (socket.gethostname(), checkpoint_problem(path, checksums=False)))
    blind = [f"rank {r} on {host} ({problem})" for r, (host, problem) in enumerate(views) if problem]
    if blind:
        raise SystemExit(f"not every rank can read checkpoint {path}: {', '.join(blind)}. out_dir must be on a "
                         "filesystem shared by all nodes: rank 0 writes the checkpoints, every rank resumes from them.")


def leave_process_group():
    """Only once the DDP model is gone: torch frees a process group without holding the GIL when it drops
    the last reference, but a DDP model freed later (at exit) frees it holding the GIL, and the exit then
    deadlocks on gloo's threads, which need the GIL to free the last collectives' tensors."""
    distributed.teardown()


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
# Resume: from the newest valid checkpoint in out_dir or, for phase="decay", from the
# phase-1 checkpoint named by init_from. A checkpoint holds the weights, the optimizer,
# the step, the data position, every rank's random streams and its loss sum since the last log.


def resume_point(c, rank, world):
    """The checkpoint to resume from, or None to start from init_from. Rank 0 checks the manifests and
    chooses; every rank must see its choice."""
    def choose():
        for tmp in glob.glob(os.path.join(c.out_dir, ".tmp-*")):  # a save that a kill interrupted
            shutil.rmtree(tmp, ignore_errors=True)
        latest = latest_valid_checkpoint(c.out_dir)
        if latest is None and c.init_from != "scratch":
            check_init_from(c.init_from)
        return os.path.basename(latest) if latest else None

    name = on_rank0(choose, rank, world > 1)
    if name:
        path = os.path.join(c.out_dir, name)
        if world > 1:
            every_rank_sees(path, world)
        return path
    if c.phase == "decay" and os.path.isfile(os.path.join(c.init_from, "train_state.pt")):
        return c.init_from
    return None


def restore(path, optimizer, loader, rank, world, device):
    """Load checkpoint `path`'s train state into the optimizer, the loader and this rank's random streams;
    return (step, tokens seen, this rank's loss sum since the last log, the number of steps in that sum)."""
    if path is None:
        return 0, 0, torch.zeros((), device=device), 0
    state = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])  # a global position: any world size continues from it
    ranks = state["ranks"]  # one entry per rank of the run that wrote it
    if len(ranks) == world:  # the same world size: every rank's random streams and loss sum continue exactly
        set_rng_state(ranks[rank]["rng"], device)
        loss_acc = ranks[rank]["loss_acc"]
    else:  # rank r now gets other micro batches than the old rank r: its streams restart from the seed,
        loss_acc = sum(r["loss_acc"] for r in ranks) if rank == 0 else 0.0  # and rank 0 carries the loss total
    return state["step"], state["tokens"], torch.tensor(loss_acc, device=device), state["loss_steps"]


def step_range(c, sched, step):
    """[first, last): the steps of the phases this run does, and the step it starts at."""
    first, last = {"all": (0, sched.main_steps + sched.decay_steps), "main": (0, sched.main_steps),
                   "decay": (sched.main_steps, sched.main_steps + sched.decay_steps)}[c.phase]
    if step < first:  # phase "decay"
        if step > 0:
            raise SystemExit(f"phase='decay' needs a checkpoint from the end of phase 1 (step {first}); "
                             f"the one found is at step {step}")
        step = first  # weights without a train state (a Hugging Face model): the decay starts fresh
    return first, last, step


def save(path, state, model, optimizer, c, rank, world, device):
    """Every rank: gather the per-rank state (random streams, loss sum); rank 0 writes the checkpoint and
    drops the oldest beyond max_ckpts; every rank checks that it sees the result."""
    mine = dict(rng=rng_state(device), loss_acc=state.pop("loss_acc"))
    ranks = [mine]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    bad = [r["loss_acc"] for r in ranks if not math.isfinite(r["loss_acc"])]
    if bad:  # a checkpoint between two logs: its loss was not checked yet
        raise loss_error(bad[0], state["step"], c.out_dir)

    def write():
        save_checkpoint(path, model, optimizer, {**state, "ranks": ranks}, c)
        for old in step_checkpoints(c.out_dir)[:-c.max_ckpts]:
            shutil.rmtree(old, ignore_errors=True)

    on_rank0(write, rank, world > 1)  # also the barrier: no rank reads the checkpoint before it is complete
    if world > 1:
        every_rank_sees(path, world)


def loss_error(loss, step, out_dir):
    return SystemExit(f"step {step}: loss is {loss}; stopping. The last good checkpoint is "
                      f"{(step_checkpoints(out_dir) or ['(none)'])[-1]}; lower lr or check the data.")


# -----------------------------------------------------------------------------
# Training


def main(argv):
    c = parse_config(argv)
    if not c.data_dir:
        raise SystemExit("data_dir is not set: point it at a directory made by `python data.py`")
    meta = load_meta(c.data_dir)
    process = distributed.setup(c.device)
    rank, world, device = process.rank, process.world, process.device  # the same without torchrun: one process
    ddp, master = world > 1, rank == 0
    if c.global_batch_size % (c.micro_batch_size * world):
        raise SystemExit(f"global_batch_size={c.global_batch_size} is not a multiple of micro_batch_size="
                         f"{c.micro_batch_size} x world size {world}")
    accum = c.global_batch_size // (c.micro_batch_size * world)
    autocast, dtype = distributed.autocast(device, c.dtype)
    compiled = {"auto": device.type == "cuda", "true": True, "false": False}[c.compile.lower()]

    resume_from = resume_point(c, rank, world)
    model = build_model(c, meta, resume_from or c.init_from).to(device)
    sched = Schedule.from_config(c)
    freeze_layers = layer_set(c.freeze_layers, model.config.num_hidden_layers)
    optimizer = make_optimizer(model, c, device)
    loader = Loader(c.data_dir, "train", c.seq_len, c.micro_batch_size, c.data_seed, rank, world)
    torch.manual_seed(c.seed + rank)  # dropout; a checkpoint's random streams replace it
    step, tokens_seen, loss_acc, loss_steps = restore(resume_from, optimizer, loader, rank, world, device)
    first, last, step = step_range(c, sched, step)
    with autocast:  # on every rank, before compile: the first call also looks up torch's varlen_attn
        backend = model.model.attention_backend(device)
    if master:
        os.makedirs(c.out_dir, exist_ok=True)
        with open(os.path.join(c.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(c), f, indent=2)
        print(json.dumps(dataclasses.asdict(c), indent=2))
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config.num_hidden_layers} layers; world "
              f"{world}, accumulation {accum}; {sched.main_steps} main + {sched.decay_steps} decay steps of "
              f"{c.global_batch_size * c.seq_len:,} tokens" + (f"; resuming at step {step}" if resume_from else ""))
        print(f"{device}, {str(dtype).removeprefix('torch.')}, attention {backend}, compile {'on' if compiled else 'off'}")
        trim_metrics(os.path.join(c.out_dir, "metrics.jsonl"), step)

    raw_model, model = model, wrap(model, compiled, ddp, device)

    def step_batches(step):
        """This rank's micro batches of `step` (all of them first: the loss divides by the global number of
        targets), the loader position after them, and their FLOPs from the real sequence lengths."""
        objective, mask_prob = sched.objective(step)
        batches = [make_batch(loader.next(), objective, mask_prob, meta, [c.seed, step, k * world + rank],
                              c.split_docs) for k in range(accum)]
        if device.type == "cuda":  # pinned: the copy to the GPU is then asynchronous
            batches = [b.map(torch.Tensor.pin_memory) for b in batches]
        seqlens = [n for b in batches for n in b.cu_seqlens.diff().tolist()]
        flops = training_flops(raw_model.config, seqlens, objective == "clm", sum(b.targets.numel() for b in batches))
        return batches, loader.state_dict(), flops

    def save_here(path):
        """The state at this step boundary, to `path`; returns the seconds it took (not training time)."""
        started = time.time()
        state = dict(step=step, tokens=tokens_seen, loader=loader_state, loss_steps=loss_steps, loss_acc=loss_acc.item())
        save(path, state, raw_model, optimizer, c, rank, world, device)
        return time.time() - started

    # Preemption (SIGTERM from a scheduler, SIGINT from Ctrl-C) only raises a flag: the ranks agree on it at
    # the next step boundary, write a checkpoint there and exit. A second signal during the save changes nothing.
    caught = {"signal": 0}
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: caught.update(signal=signum))

    peak = peak_flops(device, c.peak_tflops)
    bar = tqdm(total=last - first, initial=step - first, desc=c.phase, disable=not master or None, unit="step")
    t0, timed_steps, timed_flops, paused = time.time(), 0, 0.0, 0.0  # since the last log
    saved, saved_at = resume_from or c.init_from, time.monotonic()  # where the state at `step` is already
    loader_state = loader.state_dict()  # at the step boundary; from here on only the prefetch thread reads data
    stream = prefetch(step_batches, range(step, last))
    while step < last:
        phase, objective, lr = sched.phase(step), sched.objective(step)[0], sched.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches, next_loader_state, flops = next(stream)
        # The one all-reduce of a step also carries what the ranks must agree on at its boundary: a signal
        # that reached any of them, a time-based checkpoint that any rank's clock says is due.
        due = c.ckpt_every_minutes > 0 and time.monotonic() - saved_at >= 60 * c.ckpt_every_minutes
        agreed = torch.tensor([sum(b.targets.numel() for b in batches), caught["signal"], due, flops],
                              dtype=torch.float32, device=device)
        if ddp:
            dist.all_reduce(agreed)
        n_targets = agreed[0]
        stopping, due, flops = agreed[1:].tolist()  # waits for the previous step, as the batch copy to GPU does

        # On a signal or on time: checkpoint this boundary (once). On a signal, then stop.
        path = os.path.join(c.out_dir, f"ckpt-{step}")
        if (stopping or due) and path != saved:
            paused += save_here(path)
            saved, saved_at = path, time.monotonic()
        if stopping:
            stream.close()
            bar.close()
            code = 128 + (caught["signal"] or signal.SIGTERM)  # what a shell reports for a process the signal killed
            if master:
                why = signal.Signals(caught["signal"]).name if caught["signal"] else "a signal to another rank"
                print(f"stopped by {why} at step {step}: re-run the same command to resume from {saved} "
                      f"(exit code {code})", flush=True)
            del model
            leave_process_group()
            sys.exit(code)

        # One optimizer step: the micro batches' gradients summed, the frozen layers left as they are.
        loss_acc += backward(model, batches, objective == "clm", n_targets, world, device, autocast, compiled)
        if c.freeze_phase in (phase, "both"):
            for p in layer_params(raw_model, freeze_layers):
                p.grad = None  # AdamW skips a parameter with no gradient: no decay, no moment update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loader_state = next_loader_state
        tokens_seen += c.global_batch_size * c.seq_len
        timed_steps, timed_flops, loss_steps = timed_steps + 1, timed_flops + flops, loss_steps + 1
        bar.update(1)
        end_of_phase = step == last or sched.phase(step) != phase
        checkpoint_step = step % c.ckpt_interval == 0 or end_of_phase

        # Once in a while: evaluate, every eval_interval steps and at the end of each phase.
        val = {}
        if step % c.eval_interval == 0 or end_of_phase:
            started = time.time()
            val = evaluate(raw_model, c, meta, rank, world, device, autocast)
            paused += time.time() - started

        # Log every log_interval steps, and with each evaluation and interval checkpoint. The checkpoints
        # between two logs (on a signal, on time) keep the loss sums instead, so a resumed run logs
        # exactly what an uninterrupted one does.
        if step % c.log_interval == 0 or val or checkpoint_step:
            if ddp:
                dist.all_reduce(loss_acc)
            loss_value = loss_acc.item() / loss_steps
            if not math.isfinite(loss_value):
                raise loss_error(loss_value, step, c.out_dir)
            dt = time.time() - t0 - paused  # training time only: checkpoints and evaluations are left out
            record = dict(step=step, phase=phase, objective=objective, tokens=tokens_seen, loss=loss_value, lr=lr,
                          tokens_per_s=timed_steps * c.global_batch_size * c.seq_len / dt, **val)
            if peak:  # model FLOPs (model.training_flops, from the real sequence lengths) / time / peak per GPU
                record["mfu"] = timed_flops / dt / world / peak
            if master:
                log(record, c.out_dir, bar, last, eta=(last - step) * dt / timed_steps)
            t0, timed_steps, timed_flops, paused = time.time(), 0, 0.0, 0.0
            loss_acc, loss_steps = torch.zeros((), device=device), 0

        # Once in a while: checkpoint, every ckpt_interval steps and at the end of each phase.
        if checkpoint_step:
            saved = os.path.join(c.out_dir, f"ckpt-{step}")
            paused += save_here(saved)  # after the log: left out of the next log's tokens/s
            saved_at = time.monotonic()
    bar.close()
    save_here(os.path.join(c.out_dir, "final"))
    if master:
        mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        print(f"done: {c.out_dir}/final (step {step}, {tokens_seen:,} tokens); peak memory {mem / 2 ** 30:.2f} GiB")
    del model
    leave_process_group()


def log(record, out_dir, bar, last, eta):
    """A log step: one line of metrics.jsonl, one line on the console."""
    with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    val = "".join(f" {k} {record[k]:.4f}" for k in ("val_mlm_loss", "val_clm_loss") if k in record)
    bar.write(f"{record['phase']} {record['objective']} step {record['step']}/{last} loss {record['loss']:.4f} "
              f"lr {record['lr']:.2e} {record['tokens_per_s']:,.0f} tok/s{mfu}{val} eta {eta / 60:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1:])
