"""
Continued pretraining of ModernBERT with the CLM detour (or its MLM twin).

    python train.py configs/demo.py                               # one process, CPU or one GPU
    torchrun --nproc_per_node=4 train.py configs/fr_base.py       # DDP
    python train.py configs/fr_base.py configs/mlm_baseline.py --lr=1e-4

Training is a list of phases; the model, its head and the optimizer state carry on across every boundary. The paper's
recipe is two phases built from one flag, `objective`: "main" (the detour, or the MLM arm), then "decay" (MLM 15%, lr
1-sqrt to 0.1 lr); any other list is a config's `phases`. Re-running a command resumes from out_dir's latest valid
checkpoint, exactly. SIGTERM or SIGINT finish the step, write a checkpoint and exit with 128 + the signal number.
"""

import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from data import Loader, clm_batch, mlm_batch, prefetch
from model import ModernBertConfig, ModernBertForMaskedLM
from support import checkpoint, config, files, kernels, metrics, processes, shards
from support.flops import batch_flops

# -----------------------------------------------------------------------------
# Defaults. A config file (plain Python, `key = value` lines) or --key=value overrides any of them; anything else is an
# error. Each default of the method names its source: "the paper", "ModernBERT's recipe" (its pretraining, which the
# paper follows where its text is silent), or "our choice". The system, logging and checkpoint settings at the end are
# our choice and change no number the method computes.


@dataclass
class Config:
    out_dir: str = "out"  # checkpoints, metrics.jsonl, config.json; re-running resumes from here
    data_dir: str = ""  # a directory made by `python data.py`
    init_from: str = "scratch"  # "scratch", a Hugging Face ModernBERT directory, or one of our checkpoints
    model_size: str = "base"  # for scratch: "base" or "large" (our choice)
    model_config: dict = field(default_factory=dict)  # for scratch: ModernBertConfig overrides
    # The method: the paper's two phases, "main" and "decay", built from THE flag `objective` (phases_of)
    objective: str = "clm"  # "clm" (causal, next token: the paper's detour) or "mlm" (bidirectional: its baseline)
    mask_prob: float = 0.3  # phase-1 masking when objective == "mlm" (the paper)
    tokens: int = 10_000_000_000  # phase-1 token budget (the paper: French and English Base)
    warmup_tokens: int = 100_000_000  # linear warmup at the start of phase 1 (the paper)
    decay_frac: float = 0.1  # decay length as a fraction of `tokens` (the paper); 0: no decay phase
    decay_mask_prob: float = 0.15  # (the paper)
    final_lr_frac: float = 0.1  # the decay ends at final_lr_frac * lr (the paper)
    phases: list = field(default_factory=list)  # or any phases: dicts of Phase's fields (they replace the keys above)
    run_phases: str = "all"  # "all", or the consecutive phases this run does ("decay": from a "main" checkpoint)
    resume_changes: str = ""  # keys a resumed run changes on purpose, e.g. "tokens" (others must match config.json)
    skip_tokens: int = 0  # with no train state (a decay from a Hugging Face directory): the data starts this far in
    split_docs: bool = False  # restart attention and positions at each document (the paper does not)
    lr: float = 2e-4  # peak, shared by every phase (ModernBERT's recipe, as the optimizer below)
    # AdamW: ModernBERT's recipe (make_optimizer; the paper's text elides it, its model card gives the same lr, betas)
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-6
    weight_decay: float = 1e-5  # decoupled: p <- p * (1 - weight_decay * lr_t / lr)
    freeze_layers: str = ""  # layers with no weight gradient in the freeze_phase phases: "0-7", "8-14,20"; "": none
    freeze_phase: str = "main"  # phase names, e.g. "main" or "clm,mlm"; "all" for every phase
    freeze_mode: str = "exact"  # "exact" (our choice): no update at all (bit-identical); "zero_grad" (the paper's
    # freeze, configs/freeze_*.py): gradients zeroed, so decoupled AdamW still decays them and its moments move them
    # batch
    seq_len: int = 8192  # (the paper)
    global_batch_size: int = 384  # sequences per optimizer step, over all ranks (the paper)
    micro_batch_size: int = 4  # sequences per forward on one rank (our choice: memory only, the step is the same)
    # dropout: 0.1 after the attention output projection only (ModernBERT's recipe: the paper says only that two
    # seeds differ "in dropout and masking patterns")
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attn_out_dropout: float = 0.1
    mlp_dropout: float = 0.0
    # seeds: 17 and 42 (the paper); which one drives what (ModernBERT's recipe)
    seed: int = 17  # init, masking, dropout
    data_seed: int = 42  # data order only
    # system
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    dtype: str = "auto"  # "auto" (bfloat16 autocast on GPU, float32 on CPU), "float32", "bfloat16"
    compile: str = "auto"  # "auto": inductor on CUDA, off on CPU; True, False, or a backend ("aot_eager": kernels.py)
    attn_backend: str = "auto"  # "auto", a backend, or one per layer type ("global=cudnn,local=varlen"): kernels.py
    peak_tflops: float = 0.0  # the GPU's dense bf16 peak for MFU; 0: known from its name (support/flops.py)
    # logging, evaluation, checkpoints
    log_interval: int = 10
    eval_interval: int = 500  # also at the end of each phase
    eval_windows: int = 64  # val windows per evaluation (all of val.bin if fewer)
    ckpt_interval: int = 1000
    ckpt_every_minutes: float = 60.0  # also checkpoint when this long has passed since the last one; 0: off
    max_ckpts: int = 3  # newest full checkpoints kept (each phase's last stays too); older ones are removed, except:
    keep_every: int = 0  # steps: checkpoints at its multiples stay, weights-only, for cka.py --runs; 0: none
    dist_timeout_minutes: float = 60.0  # torchrun: how long a rank waits in a collective (rank 0 writing a checkpoint)
    wandb_project: str = ""  # also log every record to this Weights & Biases project (pip install wandb); "": off
    wandb_run_name: str = ""  # the run's name there; "": out_dir's name


# -----------------------------------------------------------------------------
# Phases and the lr schedule


@dataclass
class Phase:
    """What a stretch of training does."""
    name: str  # what metrics.jsonl, freeze_phase and run_phases call it
    objective: str  # "clm": causal mask + next-token loss; "mlm": bidirectional mask + masked-token loss
    tokens: float = 0  # its length in tokens (rounded up to whole steps), or
    steps: int = 0  # in optimizer steps (budgets written in steps do not move with the batch or seq_len)
    mask_prob: float = 0.0  # mlm: the share of tokens masked
    warmup_tokens: float = 0  # linear warmup from 0 at its start, then constant; in tokens, or
    warmup_steps: int = 0  # in steps
    decay: bool = False  # instead: no warmup, 1-sqrt from lr to final_lr_frac * lr over the phase
    final_lr_frac: float = 0.1

    @property
    def causal(self):
        return self.objective == "clm"


def phases_of(c):
    """The config's phases: `phases` as written, or the paper's two, built from the one flag `objective`."""
    if c.phases:
        phases = config.check_phases(c.phases, Phase)
    else:
        phases = [Phase("main", c.objective, c.tokens, mask_prob=c.mask_prob if c.objective == "mlm" else 0.0,
                        warmup_tokens=c.warmup_tokens)]
        if c.decay_frac:
            phases.append(Phase("decay", "mlm", c.decay_frac * c.tokens, mask_prob=c.decay_mask_prob, decay=True,
                                final_lr_frac=c.final_lr_frac))
    for phase in phases:
        config.check_phase(phase)
    return phases


def parse_config(argv):
    """Config files then --key=value, then every value in its range (support/config.py)."""
    c = config.parse(Config, argv)
    config.check_config(c, [p.name for p in phases_of(c)], int(os.environ.get("WORLD_SIZE", 1)))
    return c


class Schedule:
    """The config's phases laid end to end, in optimizer steps. At a boundary only the lr shape restarts."""

    def __init__(self, c):
        self.phases, self.lr, per_step = phases_of(c), c.lr, c.global_batch_size * c.seq_len
        self.steps = [p.steps or math.ceil(p.tokens / per_step) for p in self.phases]  # each phase in steps
        self.warmup_steps = [p.warmup_steps or math.ceil(p.warmup_tokens / per_step) for p in self.phases]
        self.starts = [sum(self.steps[:i]) for i in range(len(self.phases) + 1)]  # each phase's start, then the end

    def index(self, step):
        return max(i for i, start in enumerate(self.starts[:-1]) if start <= step)

    def at(self, step):  # the phase in force at `step`
        return self.phases[self.index(step)]

    def lr_at(self, step):
        """The phase's lr shape, counted from its own first step."""
        i = self.index(step)
        phase, t = self.phases[i], step - self.starts[i]
        if phase.decay:
            return self.lr * (phase.final_lr_frac + (1 - phase.final_lr_frac) * (1 - math.sqrt(t / self.steps[i])))
        return self.lr * min(1.0, (t + 1) / self.warmup_steps[i]) if self.warmup_steps[i] else self.lr

    def span(self, names):
        """range(first, last): the steps of the named phases ("all", or consecutive names "mlm,decay")."""
        chosen = [i for i, p in enumerate(self.phases) if names == "all" or p.name in names.split(",")]
        return range(self.starts[chosen[0]], self.starts[chosen[-1] + 1])


# -----------------------------------------------------------------------------
# Model, optimizer


def build_model(c, meta, path):
    """From scratch (path "scratch"), or from a checkpoint directory: Hugging Face ModernBERT or ours."""
    dropout = {k: getattr(c, k) for k in (*config.DROPOUTS, "attn_backend")}  # the run's, not the checkpoint's
    if path == "scratch":
        size = ModernBertConfig.large if c.model_size == "large" else ModernBertConfig  # or "base" (config.py)
        vocab = 64 * math.ceil(meta["vocab_size"] / 64)  # a multiple of 64 for fast matmuls
        ids = dict(pad_token_id=meta["pad_id"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
                   bos_token_id=meta["cls_id"], eos_token_id=meta["sep_id"])
        torch.manual_seed(c.seed)
        return ModernBertForMaskedLM(size(**{"vocab_size": vocab, **ids, **c.model_config, **dropout}))
    with files.user_error(f"init_from={path}"):  # a weights file cut short is named
        return ModernBertForMaskedLM.from_pretrained(path, **dropout)


def make_optimizer(model, c, device):
    """Decoupled AdamW. torch's AdamW decays p <- p * (1 - lr_t * wd); with wd = weight_decay / lr that is exactly
    p <- p * (1 - weight_decay * lr_t / lr), the ModernBERT/Composer form. No decay on biases and norm weights."""
    fast = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(model.param_groups(c.weight_decay / c.lr), lr=c.lr, betas=c.betas, eps=c.eps, **fast)


class Freeze:
    """The layers of freeze_layers, in the phases of freeze_phase, require no gradient: backward still flows through
    them but computes no weight gradient, and a DDP wrapper built then all-reduces none of theirs."""

    def __init__(self, c, model, phase_names):
        layers, n_layers = config.frozen_layers(c.freeze_layers), model.config.num_hidden_layers
        if layers and max(layers) >= n_layers:
            raise SystemExit(f"freeze_layers={c.freeze_layers!r}: the model has layers 0-{n_layers - 1}")
        self.params = [p for i in sorted(layers) for p in model.model.layers[i].parameters()]
        self.phases = set(phase_names if c.freeze_phase == "all" else c.freeze_phase.split(","))
        self.zero_grad, self.frozen = c.freeze_mode == "zero_grad", False

    def enter(self, phase):
        """Set which parameters train in `phase`; True when that changed (a DDP wrapper must then be rebuilt)."""
        frozen = bool(self.params) and phase.name in self.phases
        if frozen == self.frozen:
            return False
        for p in self.params:
            p.requires_grad_(not frozen)
        self.frozen = frozen
        return True

    def after_backward(self):  # freeze_mode "zero_grad": gradients of zeros, which AdamW still decays and moves
        if self.frozen and self.zero_grad:
            for p in self.params:
                p.grad = torch.zeros_like(p)


# -----------------------------------------------------------------------------
# One step (the phase's batches; forward and backward with its mask, the head only on rows with a target); evaluation


def make_batch(windows, phase, meta, seed, split_docs):
    """(B, S) windows -> the phase's flat Batch: next-token targets (clm) or BERT masking (mlm)."""
    if phase.objective == "clm":
        return clm_batch(windows, meta["eos_id"], split_docs)
    return mlm_batch(windows, phase.mask_prob, meta, meta["vocab_size"], seed, split_docs)  # meta: the special ids


def step_batches(step, phase, loader, meta, c, process, model_config):
    """This rank's micro batches of `step`, as its phase calls for, from the loader (read by the prefetch thread
    alone) -> (the batches, the loader position a checkpoint after them resumes from, their FLOPs for MFU)."""
    accum = c.global_batch_size // (c.micro_batch_size * process.world)
    micro = [make_batch(loader.next(), phase, meta, [c.seed, step, k * process.world + process.rank], c.split_docs)
             .pinned(process.device) for k in range(accum)]
    return micro, loader.state_dict(), batch_flops(model_config, micro, phase.causal)


def batch_loss(model, batch, causal):
    """The float32 sum of the cross-entropies of the batch's targets (ModernBertForMaskedLM.forward)."""
    return model(batch.tokens, causal=causal, cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                 rows=batch.rows, targets=batch.targets)


def forward_backward(model, batches, causal, process, autocast):
    """Sum the micro batches' gradients into .grad, each loss divided by the global number of targets;
    return this rank's share of the step's loss. DDP all-reduces the gradients after the last one."""
    n_targets = torch.tensor(float(sum(b.targets.numel() for b in batches)), device=process.device)
    if dist.is_initialized():
        dist.all_reduce(n_targets)
    total = 0.0
    for k, batch in enumerate(batches):
        batch = batch.to(process.device, non_blocking=True)
        with (model.no_sync() if dist.is_initialized() and k < len(batches) - 1 else nullcontext()), autocast:
            loss = batch_loss(model, batch, causal) * process.world / n_targets  # * world: DDP averages ranks
        loss.backward()
        total = total + loss.detach() / process.world
    return total


def wrap(model, process):
    """The model the steps call: compiled (one graph, one more when causal flips), then in DDP, whose all-reduce then
    follows the whole backward instead of overlapping it: a few ms a step against seconds of micro batches."""
    if process.compiled:  # the torch.compile backend, or None (eager)
        model = kernels.compile_model(model, process.compiled)
    if dist.is_initialized():
        model = DDP(model, device_ids=[process.device.index] if process.device.type == "cuda" else None)
    return model


# Evaluation (our choice): MLM loss at 15% and CLM loss on val.bin, a fixed mask seed, both arms alike so they compare
VALIDATION = [Phase("val_mlm", "mlm", 0, mask_prob=0.15), Phase("val_clm", "clm", 0)]


@torch.no_grad()
def evaluate(model, c, meta, process, autocast):
    model.eval()
    val = Loader(c.data_dir, "val", c.seq_len, c.micro_batch_size, c.data_seed, process.rank, process.world)
    n_steps = max(1, min(c.eval_windows, val.n_windows) // (c.micro_batch_size * process.world))
    sums = torch.zeros(len(VALIDATION), 2, device=process.device, dtype=torch.float64)  # (loss sum, targets)
    for k in range(n_steps):
        windows, seed = val.next(), [0, k * process.world + process.rank]
        for i, phase in enumerate(VALIDATION):
            batch = make_batch(windows, phase, meta, seed, c.split_docs).to(process.device)
            with autocast:
                sums[i, 0] += batch_loss(model, batch, phase.causal)
            sums[i, 1] += batch.targets.numel()
    if dist.is_initialized():
        dist.all_reduce(sums)
    model.train()
    return {f"{phase.name}_loss": (loss / count).item() for phase, (loss, count) in zip(VALIDATION, sums)}


# -----------------------------------------------------------------------------
# Training: the loop's state (what it carries from step to step; a checkpoint keeps it), then the loop


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on
    loader: dict = None  # the data position after `step` (data.Loader.state_dict())
    loss: torch.Tensor = None  # this rank's loss sum since the last log (a 0-d tensor on the device)
    loss_steps: int = 0  # the steps in that sum


def restore(c, process, resumed, optimizer, loader, first_step):
    """The state the loop starts from: the checkpoint `resumed`'s, the optimizer, the loader and this rank's random
    streams set to it; else (None) a fresh one at `first_step`, the data skip_tokens in."""
    torch.manual_seed(c.seed + process.rank)  # this rank's dropout stream, unless the checkpoint continues it
    if resumed is None:
        skipped = loader.skip(c.skip_tokens)  # where the phases before this run left the data
        if skipped and process.rank == 0:
            print(f"data: starting {skipped:,} tokens into the stream ({skipped // c.seq_len:,} windows; skip_tokens)")
        return TrainState(step=first_step, loader=loader.state_dict(), loss=torch.zeros((), device=process.device))
    state = TrainState(**checkpoint.load_train_state(resumed, optimizer, loader, process))
    if state.step < first_step:
        raise SystemExit(f"run_phases={c.run_phases!r} starts at step {first_step}, the end of the phases before it, "
                         f"but the checkpoint {resumed} is at step {state.step}")
    return state


def start(argv):
    """The config and all it names, checked (a mistake: one line, said once under torchrun); then this Process."""
    with processes.said_once():
        c = parse_config(argv)
        schedule = Schedule(c)
        run = schedule.span(c.run_phases)  # the steps this run does
        meta = shards.check_data(c.data_dir, c.seq_len, c.micro_batch_size, int(os.environ.get("WORLD_SIZE", 1)),
                                 len(run) * c.global_batch_size)
        checkpoint.check_start(c, meta, run.start)  # out_dir, init_from
    return c, schedule, run, meta, processes.setup(c.device, c.dist_timeout_minutes, c.compile)


def main(argv):
    c, schedule, run, meta, process = start(argv)
    autocast, dtype = processes.autocast(process.device, c.dtype)
    # The loop's state: from the checkpoint this run resumes (out_dir's newest, or init_from's), else fresh.
    checkpointer = checkpoint.Checkpointer(c, process, schedule)
    resumed = checkpointer.resume(continue_from=c.init_from if run.start > 0 else None)
    model = build_model(c, meta, resumed or c.init_from).place(process.device, dtype)  # its attention kernels chosen
    freeze = Freeze(c, model, [p.name for p in schedule.phases])
    optimizer = make_optimizer(model, c, process.device)
    loader = Loader(c.data_dir, "train", c.seq_len, c.micro_batch_size, c.data_seed, process.rank, process.world)
    state = restore(c, process, resumed, optimizer, loader, first_step=run.start)
    metrics.announce(c, model, schedule, process, dtype, state.step if resumed else None)
    freeze.enter(schedule.at(state.step))  # before DDP, which all-reduces what requires a gradient when built
    raw_model, model = model, wrap(model, process)
    logger = metrics.Logger(c, process, checkpointer, run, state.step)
    stream = prefetch(lambda step: step_batches(step, schedule.at(step), loader, meta, c, process, raw_model.config),
                      range(state.step, run.stop))  # built ahead by a thread, off the training step's path
    checkpointer.watch_signals()  # from here on, SIGTERM and SIGINT stop the run at a step boundary
    try:
        while state.step < run.stop:
            # One step of the method: the phase in force, its batches (CLM targets or MLM masking), forward and
            # backward with its mask (causal or bidirectional), the frozen layers computing no weight gradient.
            phase, lr = schedule.at(state.step), schedule.lr_at(state.step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if freeze.enter(phase):  # frozen layers: no weight gradients to compute or all-reduce
                model = wrap(raw_model, process)
            batches, loader_state, flops = next(stream)
            state.loss += forward_backward(model, batches, phase.causal, process, autocast)
            freeze.after_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step, state.loader, state.loss_steps = state.step + 1, loader_state, state.loss_steps + 1
            state.tokens += c.global_batch_size * c.seq_len
            logger.count(flops)
            end_of_phase = state.step in schedule.starts
            checkpoint_due = state.step % c.ckpt_interval == 0 or end_of_phase

            # Once in a while: evaluate; log (also with each evaluation and checkpoint); checkpoint (also at the end of
            # each phase, on a signal to any rank, then the run stops, or when ckpt_every_minutes have passed).
            val = {}
            if state.step % c.eval_interval == 0 or end_of_phase:
                with logger.pause():
                    val = evaluate(raw_model, c, meta, process, autocast)
            if state.step % c.log_interval == 0 or val or checkpoint_due:
                logger.log(state, phase, lr, val)
            if checkpointer.after_step(raw_model, optimizer, state, due=checkpoint_due, last=state.step == run.stop):
                break
        finished = checkpointer.exit_code is None
        if finished:
            checkpointer.save(os.path.join(c.out_dir, "final"), raw_model, optimizer, state)
        logger.close(state, finished)
    finally:  # also when an error stops the run: leave in order (see processes.teardown)
        stream.close()  # the prefetch thread stops and is joined
        del model  # the DDP model, before its process group
        processes.teardown()
    if not finished:
        sys.exit(checkpointer.exit_code)


if __name__ == "__main__":
    main(sys.argv[1:])
