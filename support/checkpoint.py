"""
Checkpoints: the directory format, and the Checkpointer that decides when to write one and where to resume, so that
train.py's loop only says "once in a while: checkpoint".

A checkpoint is out_dir/ckpt-STEP/ (and out_dir/final/): the Hugging Face files (config.json, model.safetensors,
tokenizer) + progress.json (step, tokens, phase) + train_state.pt (optimizer, step, tokens, data position, every
rank's random streams and loss sums) + manifest.json (size and sha256 of every other file). It is written to a
temporary directory, manifest last, synced, then renamed: a kill at any moment leaves the previous checkpoints as
they were, and one damaged later (a truncated copy, a bad disk) fails its manifest and is skipped on resume.

Retention: the newest max_ckpts full checkpoints stay, and the one at the end of each phase (the next phase, or a
branch of the run, starts there exactly). An older one whose step is a multiple of keep_every stays weights-only (no
train_state.pt with AdamW's two moments: a third of the size) for cka.py --runs; any other is removed.

On a cluster the Checkpointer also answers preemption (SIGTERM, SIGINT: checkpoint at the next step boundary, then
stop), writes one on a timer, and makes the ranks agree on all of it.
"""

import dataclasses
import glob
import hashlib
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from support.card import write_card
from support.distributed import on_rank0
from support.files import (MAX_JSON, fresh_dir, open_file, read_bytes, read_json, refuse, refuse_link, remove,
                           replace_file, sha256)
from support.lock import hold
from support.metrics import METRICS, trim_metrics
from support.tokenizer import TOKENIZER_FILES, write_hf_config

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.pt"
PROGRESS = "progress.json"  # where a checkpoint is in its run: step, tokens, phase (what cka.py --runs reads)


def save_checkpoint(path, model, optimizer, state, c, schedule=None):
    """Write the checkpoint directory `path`, its model card naming the run's phases (`schedule`); with optimizer
    None, weights-only (no train state: not a resume point). If a write fails (a full disk, a quota) the partial
    copy is removed, the previous checkpoints stay intact, and the run stops saying how much space it needs."""
    out_dir = os.path.dirname(path)
    tmp = os.path.join(out_dir, ".tmp-" + os.path.basename(path))
    try:
        refuse_link(path)  # now, rather than at the rename, the checkpoint written
        tokenizer = tokenizer_files(c.data_dir)
        model.save_pretrained(fresh_dir(tmp))  # made here: what is written into it lands in it
        for name, data in tokenizer.items():
            replace_file(os.path.join(tmp, name), data)
        write_hf_config(tmp, model.config.max_position_embeddings)  # so that transformers' tools know [MASK] & co
        write_card(tmp, c, state["step"], state.get("tokens", 0), model, schedule)  # README.md: what the hub shows
        with open_file(os.path.join(tmp, PROGRESS)) as f:
            json.dump({k: state[k] for k in ("step", "tokens", "phase") if k in state}, f)
        if optimizer is not None:
            torch.save({**state, "optimizer": optimizer.state_dict(), "config": dataclasses.asdict(c)},
                       os.path.join(tmp, TRAIN_STATE))
        # Hashing reads every file back: a few seconds for a Large checkpoint (about 5 GB with the optimizer).
        manifest = {}
        for name in sorted(os.listdir(tmp)):
            file = os.path.join(tmp, name)
            manifest[name] = {"bytes": os.path.getsize(file), "sha256": sha256(file)}
            fsync(file)
        replace_file(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))  # synced
        fsync(tmp)
        remove(path)  # "final" of a re-run, or a damaged copy of this step
        os.replace(tmp, path)
        fsync(out_dir)
    except (OSError, RuntimeError, SafetensorError) as e:  # how open(), torch.save and safetensors report it
        remove(tmp)
        moments = [t for s in (optimizer.state.values() if optimizer else []) for t in s.values() if torch.is_tensor(t)]
        need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *moments])
        free = shutil.disk_usage(out_dir).free
        raise SystemExit(f"could not write checkpoint {path}: {e}. A checkpoint needs about {need / 2 ** 30:.3g} GiB "
                         f"and {out_dir} has {free / 2 ** 30:.3g} GiB free. The previous checkpoints are intact: free "
                         "some space (or lower max_ckpts, or move out_dir) and re-run the same command to resume.")


def tokenizer_files(data_dir):
    """{name: bytes} of the data's tokenizer files, as each checkpoint gets them, once they are the data's own:
    tokenizer.json when its sha256 is the one meta.json records (wherever a link there leads), another file when it
    is no link. Anything else would copy into a checkpoint, which travels, a file from elsewhere: refused."""
    files = {}
    try:
        sha = read_json(os.path.join(data_dir, "meta.json")).get("tokenizer_sha256")
        for name in TOKENIZER_FILES:
            src = os.path.join(data_dir, name)
            known = sha if name == "tokenizer.json" else None
            if os.path.islink(src) and not known:
                refuse(src, f"a symbolic link to {os.readlink(src)}, which would copy that file into every checkpoint")
            if os.path.lexists(src):
                files[name] = read_bytes(src, MAX_JSON)
                if known and hashlib.sha256(files[name]).hexdigest() != known:
                    raise SystemExit(f"{src} is not the tokenizer {data_dir} was made with (meta.json records another "
                                     "sha256): put that one back, or re-run data.py into a fresh --out")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: the checkpoints copy the tokenizer from the data directory") from None
    return files


def fsync(path):
    """Flush a file, or a directory's entries, to disk (a rename is only durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(path):
    """{file name: {"bytes": size, "sha256": hex digest}} of the checkpoint `path`; else a ValueError naming it."""
    file = os.path.join(path, MANIFEST)
    manifest = read_json(file)
    for name, entry in manifest.items():
        if (name in ("", ".", "..") or "/" in name or os.sep in name or not isinstance(entry, dict)
                or type(entry.get("bytes")) is not int or entry["bytes"] < 0
                or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256")))):
            raise ValueError(f"{file}: its entry {name!r} is not a file of the directory with its bytes and sha256")
    return manifest


def weights_only(path):
    """A checkpoint whose manifest lists no train state (a keep_every one): weights for analysis, not a
    resume point. One with an unreadable manifest is not: it is damaged, and resume says so."""
    try:
        return TRAIN_STATE not in read_manifest(path)
    except (OSError, ValueError):
        return False


def checkpoint_problem(path, checksums=True, train_state=True):
    """What is wrong with the checkpoint directory `path`, or None if every file its manifest lists is
    there with its size and (if checksums) its sha256. train_state False: the weights alone may be asked for, and
    a checkpoint shared without its train_state.pt (as README says to) is not damaged."""
    if not os.path.isdir(path):
        return "no such directory"
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return f"no {MANIFEST}: it was not written completely"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, want in manifest.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            if name == TRAIN_STATE and not train_state:
                continue
            return f"{name} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {want['bytes']} (truncated?)"
        if checksums and sha256(file) != want["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def step_of(path):
    return int(path.rsplit("-", 1)[1])


def step_checkpoints(out_dir):
    """The ckpt-STEP directories in out_dir, complete or not, oldest first; one that is a link is refused."""
    found = [p for p in glob.glob(os.path.join(out_dir, "ckpt-*")) if re.fullmatch(r"ckpt-\d+", os.path.basename(p))]
    for p in found:
        refuse_link(p)
    return sorted(found, key=step_of)


def full_checkpoints(out_dir):
    """The ckpt-STEP directories a run can resume from (all but the weights-only ones), oldest first."""
    return [p for p in step_checkpoints(out_dir) if not weights_only(p)]


def latest_valid_checkpoint(out_dir):
    """The newest full checkpoint in out_dir that passes its manifest (None if out_dir has none). Each damaged
    newer one gets a warning; if all are damaged the run stops rather than start over silently."""
    damaged = []
    for path in reversed(full_checkpoints(out_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"warning: checkpoint {path} is damaged ({problem}); trying the one before it", file=sys.stderr)
        damaged.append(path)
    if damaged:
        raise SystemExit(f"no valid checkpoint in {out_dir}: {', '.join(damaged)} are damaged (see the warnings). "
                         "Restore one from a copy, or move them away to start over from init_from.")
    return None


def prune(out_dir, max_ckpts, keep_every, phase_ends=()):
    """Retention (see above): the checkpoints at the `phase_ends` steps stay too."""
    for old in full_checkpoints(out_dir)[:-max_ckpts]:
        if step_of(old) in phase_ends:
            continue
        if keep_every and step_of(old) % keep_every == 0:
            drop_train_state(old)
        else:
            remove(old)


def drop_train_state(path):
    """Make a checkpoint weights-only: the file first, then the manifest (a kill in between leaves one that names a
    missing train state, which the next prune finishes). One with no readable manifest is left as it is (damaged)."""
    try:
        manifest = read_manifest(path)
    except (OSError, ValueError):
        return
    remove(os.path.join(path, TRAIN_STATE))
    manifest.pop(TRAIN_STATE, None)
    replace_file(os.path.join(path, MANIFEST), json.dumps(manifest, indent=1))
    fsync(path)


def load_train_state(path):
    """train_state.pt as tensors and plain data only: a pickle that would build other objects (run code): refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SystemExit(f"{path}: refused: it holds objects other than tensors and plain data, and loading them would "
                         "run code (train.py never writes such a file). Take the checkpoint from a source you trust, or "
                         "delete this file to keep only its weights (then it is no resume point)") from None


# Random streams: every rank has its own (dropout; the CPU's, and on CUDA the GPU's, which is what
# dropout draws from there). A checkpoint keeps them all, per rank, so a resume continues them exactly.

def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:  # a CPU checkpoint resumed on GPU keeps the seed's GPU stream
        torch.cuda.set_rng_state(state["cuda"], device)


# -----------------------------------------------------------------------------


@dataclass
class TrainState:
    """What the training loop carries from step to step, and a checkpoint keeps."""
    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on
    loader: dict = None  # the data position after `step` (data.Loader.state_dict())
    loss: torch.Tensor = None  # this rank's loss sum since the last log (a 0-d tensor on the device)
    loss_steps: int = 0  # the steps in that sum


class Checkpointer:
    """Resume, and "once in a while: checkpoint", for every rank of a run: rank 0 decides and writes, every rank
    gets the outcome (errors included) and checks that it sees it. `schedule` names the phase each checkpoint is in.
    It holds out_dir from the start (support/lock.py): a second run on it is refused before any work."""

    def __init__(self, c, process, schedule):
        self.c, self.process, self.schedule = c, process, schedule
        # rank 0's; says "stopping" once a signal stops the run. The same-run check runs under it: a run that held
        # out_dir before has written all it will (its last checkpoint and config.json), and no other run starts.
        self.hold = hold(c.out_dir, process, "out_dir", check=lambda: check_same_run(c))
        self.saved, self.saved_at = None, time.monotonic()  # where the state at the current step already is
        self.written = []  # the seconds of each checkpoint this process wrote: not training time
        self.caught = 0  # the signal that reached this rank, if any
        self.exit_code = None  # set when a signal stopped the run

    def watch_signals(self):
        """From now on a signal only raises a flag: the ranks agree on it at the next step boundary, write a
        checkpoint there (or use the one just written) and stop. A second signal changes nothing. Meanwhile out_dir's
        lock says "stopping": a requeued job that finds it held waits for this run's checkpoint."""
        def caught(signum, frame):
            if not self.caught and self.hold:
                self.hold.stopping()
            self.caught = signum

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, caught)

    def resume(self, continue_from=None):
        """The newest valid checkpoint in out_dir, else `continue_from` if it has a train state (a phase-1
        checkpoint for a run of the later phases), else None (init_from)."""
        def choose():
            for tmp in glob.glob(os.path.join(self.c.out_dir, ".tmp-*")):  # a save that a kill interrupted
                remove(tmp)
            latest = latest_valid_checkpoint(self.c.out_dir)
            return os.path.basename(latest) if latest else None

        name = on_rank0(choose, self.process)
        if name:
            self.saved = os.path.join(self.c.out_dir, name)
            every_rank_sees(self.saved, self.process)
        elif continue_from and os.path.isfile(os.path.join(continue_from, "train_state.pt")):
            self.saved = continue_from
        return self.saved

    def restore(self, path, optimizer, loader, first_step=0):
        """The TrainState at checkpoint `path` (None: a fresh start), with the optimizer, the loader and this
        rank's random streams (dropout's; fresh: from seed + rank) set to it; metrics.jsonl is cut back to its step. A
        run of later phases starts at `first_step`, from a checkpoint of the phases before it."""
        device, rank = self.process.device, self.process.rank
        torch.manual_seed(self.c.seed + rank)
        if path is None and self.c.skip_tokens:
            skipped = skip_data(loader, self.c.skip_tokens)
            if rank == 0:
                print(f"data: starting {skipped:,} tokens into the stream ({skipped // loader.seq_len:,} windows; "
                      f"skip_tokens={self.c.skip_tokens:,})")
        elif path is None and first_step > 0 and rank == 0:
            print(f"warning: {self.c.init_from} has no train state, so the data position restarts at the stream's "
                  f"beginning and run_phases={self.c.run_phases!r} replays the data of the phases before it. If those "
                  f"phases trained on this data_dir with this data_seed, pass --skip_tokens="
                  f"{first_step * self.c.global_batch_size * self.c.seq_len} (where the uninterrupted run stands at "
                  f"step {first_step})", file=sys.stderr)
        state = TrainState(loader=loader.state_dict(), loss=torch.zeros((), device=device))
        if path is not None:
            file = os.path.join(path, TRAIN_STATE)
            saved = load_train_state(file)
            try:  # a file of another shape (another code's, hand-made) fails here, before anything is written
                optimizer.load_state_dict(saved["optimizer"])
                loader.load_state_dict(saved["loader"])  # a global position: any world size continues from it
                ranks = saved["ranks"]  # one entry per rank of the run that wrote it
                if len(ranks) == self.process.world:  # the same world: every rank's streams and loss sum continue
                    set_rng_state(ranks[rank]["rng"], device)
                    loss = ranks[rank]["loss_acc"]
                else:  # rank r now gets other micro batches than the old rank r: its streams restart from the seed,
                    loss = sum(r["loss_acc"] for r in ranks) if rank == 0 else 0.0  # rank 0 carries the loss total
                state = TrainState(step=saved["step"], tokens=saved["tokens"], loader=saved["loader"],
                                   loss=torch.tensor(loss, device=device), loss_steps=saved["loss_steps"])
                if not all(type(n) is int for n in (state.step, state.tokens, state.loss_steps)):
                    raise TypeError("step, tokens and loss_steps must be integers")
            except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
                raise SystemExit(f"{file}: not a train state this code wrote ({type(e).__name__}: {e}). Restore the "
                                 "checkpoint from a copy, or move it away to resume from the one before") from None
        if state.step < first_step:
            if state.step > 0:
                raise SystemExit(f"run_phases={self.c.run_phases!r} starts at step {first_step}, the end of the phases "
                                 f"before it, but the checkpoint {path} is at step {state.step}")
            state.step = first_step  # weights without a train state (a Hugging Face model): start the phase fresh
        if rank == 0:
            trim_metrics(os.path.join(self.c.out_dir, METRICS), state.step)
        self.saved_at = time.monotonic()  # the timer for ckpt_every_minutes starts with the training
        return state

    def after_step(self, model, optimizer, state, due, last=False):
        """At the step boundary `state.step`: write ckpt-STEP if `due` (the loop's interval, a phase's end), or if a
        signal reached any rank, or ckpt_every_minutes passed on any rank's clock; else, at a multiple of
        keep_every, weights-only. -> True when a signal came: the checkpoint is written and the run must stop
        (exit_code says how), unless this is the `last` step, which ends the run with its final checkpoint anyway."""
        stopping, late = self.agree()
        if stopping and self.hold and not self.caught:  # the signal reached another rank
            self.hold.stopping()
        path = os.path.join(self.c.out_dir, f"ckpt-{state.step}")
        if (due or stopping or late) and path != self.saved:
            self.save(path, model, optimizer, state)
            stopping = stopping or self.agree()[0]  # a signal during the save: this checkpoint answers it
        elif self.c.keep_every and state.step % self.c.keep_every == 0 and path != self.saved:
            self.save(path, model, None, state)  # a trajectory point, not a resume point
        if not stopping or last:
            return False
        self.exit_code = 128 + (self.caught or signal.SIGTERM)  # what a shell reports for a process it killed
        if self.process.rank == 0:
            why = signal.Signals(self.caught).name if self.caught else "a signal to another rank"
            print(f"stopped by {why} at step {state.step}: re-run the same command to resume from {self.saved} "
                  f"(exit code {self.exit_code})", flush=True)
        return True

    def agree(self):
        """(a signal reached some rank, ckpt_every_minutes passed on some rank's clock), the same on every rank."""
        late = self.c.ckpt_every_minutes > 0 and time.monotonic() - self.saved_at >= 60 * self.c.ckpt_every_minutes
        if not dist.is_initialized():
            return bool(self.caught), late
        flags = torch.tensor([self.caught, late], dtype=torch.float32, device=self.process.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stopping, late = flags.tolist()  # waits for the step, as the next step's batch copy would
        return bool(stopping), bool(late)

    def save(self, path, model, optimizer, state):
        """Every rank: rank 0 writes the checkpoint and prunes, every rank checks that it sees the result. With the
        optimizer, a resume point (every rank's random streams and loss sum gathered); without (None), weights-only."""
        started = time.time()  # the phase of the last step done:
        saved = dict(step=state.step, tokens=state.tokens, phase=self.schedule.at(max(state.step - 1, 0)).name)
        if optimizer is not None:
            mine = dict(rng=rng_state(self.process.device), loss_acc=state.loss.item())
            ranks = [mine]
            if dist.is_initialized():
                ranks = [None] * self.process.world
                dist.all_gather_object(ranks, mine)
            bad = [r["loss_acc"] for r in ranks if not math.isfinite(r["loss_acc"])]
            if bad:  # a checkpoint between two logs: its loss was not checked yet
                raise loss_error(bad[0], state.step, self.c.out_dir)
            saved.update(loader=state.loader, loss_steps=state.loss_steps, ranks=ranks)

        def write():
            save_checkpoint(path, model, optimizer, saved, self.c, self.schedule)
            prune(self.c.out_dir, self.c.max_ckpts, self.c.keep_every, self.schedule.starts[1:])

        on_rank0(write, self.process)  # also the barrier: no rank reads the checkpoint before it is complete
        every_rank_sees(path, self.process)
        if optimizer is not None:
            self.saved, self.saved_at = path, time.monotonic()
        self.written.append(time.time() - started)


def loss_error(loss, step, out_dir):
    return SystemExit(f"step {step}: loss is {loss}; stopping. The last good checkpoint is "
                      f"{(full_checkpoints(out_dir) or ['(none)'])[-1]}; lower lr or check the data.")


def skip_data(loader, tokens):
    """Move a fresh data.Loader past the first `tokens` tokens of the stream, in whole windows: where an
    uninterrupted run that had trained on those tokens would stand. -> the tokens skipped."""
    windows = tokens // loader.seq_len
    loader.load_state_dict({**loader.state_dict(), "consumed": loader.state_dict()["consumed"] + windows})
    return windows * loader.seq_len


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
    """A run resumed from out_dir (one with checkpoints) is the run its config.json describes: refuse a config that
    changes it. Under the hold on out_dir (Checkpointer), so that the checkpoints it sees are those the run resumes."""
    path = os.path.join(c.out_dir, "config.json")
    if not step_checkpoints(c.out_dir) or not os.path.lexists(path):
        return
    try:
        old = read_json(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: it says which run {c.out_dir} holds. Put it back (each checkpoint's train_state.pt "
                         "holds the run's config), or choose a new out_dir") from None
    new = run_config(c)
    keep = RUN_SETTINGS | {k.strip() for k in c.resume_changes.split(",")}
    changed = [k for k in new if k in old and k not in keep and old[k] != new[k]]
    if changed:
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


def every_rank_sees(path, process):
    """Each rank checks (sizes only) `path`, which rank 0 wrote: a node that cannot see it would resume elsewhere."""
    if not dist.is_initialized():
        return
    views = [None] * process.world
    dist.all_gather_object(views, (socket.gethostname(), checkpoint_problem(path, checksums=False)))
    blind = [f"rank {r} on {host} ({problem})" for r, (host, problem) in enumerate(views) if problem]
    if blind:
        raise SystemExit(f"not every rank can read checkpoint {path}: {', '.join(blind)}. out_dir must be on a "
                         "filesystem shared by all nodes: rank 0 writes the checkpoints, every rank resumes from them.")
