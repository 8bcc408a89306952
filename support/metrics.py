"""
The training log: on the console, in out_dir/metrics.jsonl (written, read, cut back on resume) and in W&B.

What a run is, at its start; then one line per log step (console, metrics.jsonl, W&B): the loss averaged over the
steps since the last log and over all ranks, the lr, tokens/s and MFU. tokens/s and MFU measure training alone: a
record gives the seconds of evaluations and checkpoints apart (eval_s, checkpoint_s), torch.compile's counted in
(compile_s). At the end, where the time outside the steps went.

metrics.jsonl is the run's history: one JSON object per line, each with the integer `step` it was logged at, in the
order logged. A resume cuts it back to the step it resumes at and no further. A line that is no such record (a hand
edit, another tool's line, a damaged disk) is skipped by its readers and kept by a cut, with a warning; a last line
without its newline is a write that a kill cut short, and goes.
"""

import json
import math
import os
import resource
import secrets
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from tqdm import tqdm

from support import threads
from support.config import run_config
from support.files import open_file, read_bytes, refuse_link, replace_file
from support.flops import peak_flops

METRICS = "metrics.jsonl"


class Logger:
    def __init__(self, c, process, checkpointer, run, step):
        """`run`: the steps this run does; `step`: where it starts, and metrics.jsonl is cut back to (trim_metrics)."""
        self.c, self.process, self.checkpointer, self.compiled = c, process, checkpointer, process.compiled
        if process.rank == 0:
            trim_metrics(os.path.join(c.out_dir, METRICS), step)
        self.evaluations = []  # the seconds of each evaluation
        self.last, self.peak = run.stop, peak_flops(process.device, c.peak_tflops)
        self.bar = tqdm(total=len(run), initial=step - run.start, desc=c.run_phases, unit="step",
                        disable=process.rank != 0 or None)
        self.wandb = wandb_run(c) if c.wandb_project and process.rank == 0 else None
        self.reset()

    def reset(self):
        self.started, self.paused, self.saves = time.time(), 0.0, len(self.checkpointer.written)
        self.compiling = compile_stats()["seconds"] if self.compiled else 0.0
        self.steps, self.flops = 0, 0.0

    def count(self, flops):
        """A step done, with this rank's model FLOPs; then, on CPU, threads.follow on the thread that runs the ops."""
        self.steps, self.flops = self.steps + 1, self.flops + flops
        self.bar.update(1)
        threads.follow()

    @contextmanager
    def pause(self):
        """Time that is not training (an evaluation); the steps before it finish first, as training time."""
        if self.process.device.type == "cuda":
            torch.cuda.synchronize(self.process.device)
        started = time.time()
        yield
        self.evaluations.append(time.time() - started)
        self.paused += self.evaluations[-1]

    def log(self, state, phase, lr, val):
        """Log the mean loss since the last log (all ranks), then start the next sum."""
        loss, flops = state.loss, torch.tensor(self.flops, dtype=torch.float64, device=self.process.device)
        if dist.is_initialized():
            dist.all_reduce(loss)
            dist.all_reduce(flops)
        loss = loss.item() / state.loss_steps
        if not math.isfinite(loss):
            raise self.checkpointer.loss_error(loss, state.step)
        saving = sum(self.checkpointer.written[self.saves:])
        dt = time.time() - self.started - self.paused - saving
        record = dict(step=state.step, phase=phase.name, objective=phase.objective, tokens=state.tokens, loss=loss,
                      lr=lr, tokens_per_s=self.steps * self.c.global_batch_size * self.c.seq_len / dt, **val)
        if self.peak:  # model FLOPs (from the real sequence lengths) / time / peak per GPU
            record["mfu"] = flops.item() / dt / self.process.world / self.peak
        compiling = compile_stats()["seconds"] - self.compiling if self.compiled else 0.0
        record.update({k: round(v, 3) for k, v in dict(eval_s=self.paused, checkpoint_s=saving,
                                                        compile_s=compiling).items() if v > 0})
        if self.process.rank == 0:
            with open_file(os.path.join(self.c.out_dir, METRICS), "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.wandb:
                self.wandb.log(record, step=state.step)
            mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
            val = "".join(f" {k} {v:.4f}" for k, v in val.items())
            eta = (self.last - state.step) * dt / self.steps
            self.bar.write(f"{phase.name} {phase.objective} step {state.step}/{self.last} loss {loss:.4f} lr {lr:.2e} "
                           f"{record['tokens_per_s']:,.0f} tok/s{mfu}{val} eta {eta / 60:.1f} min")
        state.loss, state.loss_steps = torch.zeros((), device=self.process.device), 0
        self.reset()

    def close(self, state, finished):
        self.bar.close()
        if self.wandb:
            self.wandb.finish()
        if finished and self.process.rank == 0:
            device = self.process.device
            mem = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
            print(f"done: {self.c.out_dir}/final (step {state.step}, {state.tokens:,} tokens); peak memory "
                  f"{mem / 2 ** 30:.2f} GiB")
            saves = self.checkpointer.written
            line = (f"outside the steps: {len(self.evaluations)} evaluations in {sum(self.evaluations):.2f} s, "
                    f"{len(saves)} checkpoints in {sum(saves):.2f} s (the longest {max(saves, default=0):.2f} s)")
            if self.compiled:
                s = compile_stats()
                why = f": {'; '.join(s['recompiles'])}" if s["recompiles"] else ""
                line += (f"; {self.compiled} compiled {s['graphs']} graphs in {s['seconds']:.1f} s, {s['breaks']} "
                         f"graph breaks, {len(s['recompiles'])} recompiles{why}")
            print(line)


def compile_stats():
    """What torch.compile did in this process so far: seconds compiling, graphs, graph breaks, why each recompile
    happened. Dynamo's own records (no public API): a torch that moves them costs these figures, never the run."""
    try:
        from torch._dynamo.utils import calculate_time_spent, counters, get_compilation_metrics
        reasons = [m.recompile_reason.split("\n")[0].split(": ", 1)[-1].split(" #")[0].strip()  # "0/0: guard  # src"
                   for m in get_compilation_metrics() if getattr(m, "recompile_reason", None)]
        return dict(seconds=calculate_time_spent().get("total_wall_time", 0.0),
                    graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()),
                    recompiles=reasons)
    except (ImportError, AttributeError, KeyError, TypeError):
        return dict(seconds=0.0, graphs="?", breaks="?", recompiles=[])


def announce(c, model, schedule, process, dtype, resumed_at):
    """At the start, on rank 0: config.json in out_dir, and what this run is (its batches' attention kernels)."""
    if process.rank != 0:
        return
    config = json.dumps(run_config(c), indent=2)
    replace_file(os.path.join(c.out_dir, "config.json"), config)
    print(config)
    per_step = c.global_batch_size * c.seq_len
    resuming = "" if resumed_at is None else f"; resuming at step {resumed_at}"
    print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config.num_hidden_layers} layers; "
          f"{schedule.starts[-1]:,} steps of {c.global_batch_size} x {c.seq_len} = {per_step:,} tokens{resuming}")
    accum = c.global_batch_size // (c.micro_batch_size * process.world)
    group = f" ({dist.get_backend()} DDP)" if dist.is_initialized() else ""  # under torchrun, a world of one too
    print(f"world {process.world}{group}, accumulation {accum}; {process.device}, {str(dtype).removeprefix('torch.')}, "
          f"attention {model.model.kernels.of(packed=not c.split_docs)}, compile {process.compiled or 'off'}"
          + threads.describe())
    print(f"phases ({'from the phases key' if c.phases else 'the two built from objective, tokens, decay_frac'}):")
    print("\n".join(f"  {line}" for line in phase_lines(schedule, per_step, c.lr)))


def phase_lines(schedule, per_step, lr):
    """One line per phase, aligned: its steps, its length as given (tokens or steps), its objective, its lr."""
    rows = []
    for p, n, start in zip(schedule.phases, schedule.steps, schedule.starts):
        length = f"{n:,} steps = {n * per_step:,} tokens" if p.steps else f"{p.tokens:,.0f} tokens -> {n:,} steps"
        objective = f"mlm {p.mask_prob:.0%} (bidirectional)" if p.objective == "mlm" else "clm (causal, next token)"
        rows.append([p.name, f"steps {start:,}-{start + n - 1:,}", length, objective, lr_shape(p, lr)])
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows]


def lr_shape(phase, lr):
    """A phase's lr, in words (the card's recipe, the start-up lines): its warmup as the phase gives it."""
    if phase.decay:
        return f"1-sqrt decay from {lr:g} to {phase.final_lr_frac * lr:g}"
    if phase.warmup_steps:
        return f"warmup over {phase.warmup_steps:,} steps, then {lr:g}"
    if phase.warmup_tokens:
        return f"warmup over {phase.warmup_tokens:,.0f} tokens, then {lr:g}"
    return f"constant {lr:g}"


def wandb_run(c):
    """The Weights & Biases run that mirrors metrics.jsonl, with the config. Its id is kept in out_dir/wandb_id:
    a resumed run (a requeued job) continues the same W&B run. W&B ignores the steps a resume logs again after a
    kill (it only takes a step above its last one): those records were logged before, with the same numbers."""
    import wandb  # optional: only for runs that set wandb_project (support/config.py checked it is there)
    id_file = os.path.join(c.out_dir, "wandb_id")
    if not os.path.lexists(id_file):
        replace_file(id_file, secrets.token_hex(4))  # W&B's form of id: 8 lowercase letters or digits
    try:
        run_id = read_bytes(id_file, 64).decode().strip()
    except (OSError, ValueError) as e:  # a decoding error is a ValueError
        raise SystemExit(f"{e}: it names this run's W&B run; remove it to start a new W&B run") from None
    return wandb.init(project=c.wandb_project, name=c.wandb_run_name or os.path.basename(os.path.abspath(c.out_dir)),
                      id=run_id, resume="allow", config=run_config(c), dir=c.out_dir)


def record(line):
    """The record on `line` (bytes), or None if it holds none."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and type(value.get("step")) is int else None


def lines(path):
    """Each complete line of the file `path` (none if there is no file), as bytes, with its record or None."""
    if not os.path.lexists(path):
        return []
    try:
        data = read_bytes(path, 1 << 30)  # bytes: a million logged steps take about 300 MB
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: {path} is the run's log; move it away to start a new one") from None
    return [(line + b"\n", record(line)) for line in data.split(b"\n")[:-1]]


def records(path):
    return [r for _, r in lines(path) if r]


def trim_metrics(path, step):
    """Cut metrics.jsonl back to `step`, the resume point: records past it go, lines that hold no record stay."""
    if not os.path.lexists(path):
        return
    refuse_link(path)  # before its lines are read: they are not the run's
    kept = [(n, line, r) for n, (line, r) in enumerate(lines(path), 1) if r is None or r["step"] <= step]
    if other := [n for n, _, r in kept if r is None]:
        print(f"warning: {path}: line(s) {', '.join(map(str, other[:10]))}{' ...' if len(other) > 10 else ''} hold "
              "no record (a JSON object with an integer step): kept as they are; readers skip them", file=sys.stderr)
    replace_file(path, b"".join(line for _, line, _ in kept))
