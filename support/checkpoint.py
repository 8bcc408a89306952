"""
Checkpoints: the directory format and its lifecycle (save atomically, prune, choose what to resume, preemption).

A checkpoint is out_dir/ckpt-STEP/ (and out_dir/final/): the Hugging Face files (config.json, model.safetensors,
tokenizer) + progress.json (step, tokens, phase) + train_state.pt (optimizer, step, tokens, data position, every
rank's random streams and loss sums) + manifest.json (size and sha256 of every other file). It is written to a
temporary directory, manifest last, synced, then renamed: a kill at any moment leaves the previous checkpoints as
they were, and one damaged later (a truncated copy, a bad disk) fails its manifest and is skipped on resume.

Retention: the newest max_ckpts full checkpoints stay, and the one at the end of each phase (the next phase, or a
branch of the run, starts there exactly). An older one whose step is a multiple of keep_every stays weights-only (no
train_state.pt with AdamW's two moments: a third of the size) for cka.py --runs; any other is removed.
"""

import dataclasses
import glob
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

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from model import ModernBertConfig
from support import hf
from support.card import write_card
from support.config import check_same_run, check_seq_len
from support.processes import on_rank0
from support.files import (check_out_dir, fresh_dir, open_file, read_json, refuse_link, remove, replace_file, sha256,
                           user_error, whole)
from support.lock import hold
from support.shards import tokenizer_files
from support.tokenizer import check_vocab, write_hf_config

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.pt"
PROGRESS = "progress.json"  # where a checkpoint is in its run: step, tokens, phase (what cka.py --runs reads)


def save_checkpoint(path, model, optimizer, state, c, schedule=None):
    """Write the checkpoint directory `path`, its model card naming the run's phases (`schedule`); with optimizer
    None, weights-only (no train state: not a resume point). A failed write leaves the previous checkpoints intact."""
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
                or not whole(entry.get("bytes")) or not re.fullmatch(r"[0-9a-f]{64}", str(entry.get("sha256")))):
            raise ValueError(f"{file}: its entry {name!r} is not a file of the directory with its bytes and sha256")
    return manifest


def weights_only(path):
    """A keep_every checkpoint: its manifest lists no train state (one with an unreadable manifest is damaged)."""
    try:
        return TRAIN_STATE not in read_manifest(path)
    except (OSError, ValueError):
        return False


def checkpoint_problem(path, checksums=True, train_state=True):
    """What is wrong with the checkpoint directory `path`, or None if every file its manifest lists is there with its
    size and (if checksums) its sha256; train_state False: one shared without its train_state.pt is not damaged."""
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
        if (problem := checkpoint_problem(path)) is None:
            return path
        print(f"warning: checkpoint {path} is damaged ({problem}); trying the one before it", file=sys.stderr)
        damaged.append(path)
    if damaged:
        raise SystemExit(f"no valid checkpoint in {out_dir}: {', '.join(damaged)} are damaged (see the warnings). "
                         "Restore one from a copy, or move them away to start over from init_from.")


def prune(out_dir, max_ckpts, keep_every, phase_ends=()):
    """Retention (see above): the checkpoints at the `phase_ends` steps stay too."""
    for old in [p for p in full_checkpoints(out_dir)[:-max_ckpts] if step_of(p) not in phase_ends]:
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


def load_train_state(path, optimizer, loader, process):
    """Set the optimizer, the loader and this rank's random streams to the train state of the checkpoint `path` ->
    the loop's state there (step, tokens, loader, loss: this rank's loss sum, loss_steps). A pickle that would build
    other objects (run code) is refused; a file of another shape fails here, before anything is written."""
    file = os.path.join(path, TRAIN_STATE)
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise SystemExit(f"{file}: refused: it holds objects other than tensors and plain data, and loading them "
                         "would run code (train.py never writes such a file). Take the checkpoint from a source you "
                         "trust, or delete this file to keep only its weights (then it is no resume point)") from None
    try:
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # a global position: any world size continues from it
        ranks = saved["ranks"]  # one entry per rank of the run that wrote it
        if len(ranks) == process.world:  # the same world: every rank's streams and loss sum continue
            set_rng_state(ranks[process.rank]["rng"], process.device)
            loss = ranks[process.rank]["loss_acc"]
        else:  # rank r now gets other micro batches than the old rank r: its streams stay the seed's,
            loss = sum(r["loss_acc"] for r in ranks) if process.rank == 0 else 0.0  # rank 0 carries the loss total
        state = dict(step=saved["step"], tokens=saved["tokens"], loader=saved["loader"],
                     loss=torch.tensor(loss, device=process.device), loss_steps=saved["loss_steps"])
        if not all(type(state[k]) is int for k in ("step", "tokens", "loss_steps")):
            raise TypeError("step, tokens and loss_steps must be integers")
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise SystemExit(f"{file}: not a train state this code wrote ({type(e).__name__}: {e}). Restore the "
                         "checkpoint from a copy, or move it away to resume from the one before") from None
    return state


# Each rank's random streams (dropout's: the CPU's, on CUDA the GPU's), kept per rank: a resume continues them exactly.

def rng_state(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:  # a CPU checkpoint resumed on GPU keeps the seed's GPU stream
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Resume, and "once in a while: checkpoint", for every rank of a run: rank 0 decides and writes, every rank gets
    the outcome and checks that it sees it. It holds out_dir from the start: a second run on it is refused at once."""

    def __init__(self, c, process, schedule):
        self.c, self.process, self.schedule = c, process, schedule
        # rank 0's; says "stopping" once a signal stops the run. check_same_run runs under it (see there).
        self.hold = hold(c.out_dir, process, "out_dir", check=lambda: check_same_run(c))
        self.saved, self.saved_at = None, time.monotonic()  # where the state at the current step already is
        self.written = []  # the seconds of each checkpoint this process wrote: not training time
        self.caught, self.exit_code = 0, None  # the signal that reached this rank, if any; the run's exit code then

    def watch_signals(self):
        """As the training (and ckpt_every_minutes' clock) starts: from now on a signal only raises a flag (after_step
        acts on it; a second changes nothing), and out_dir's lock says "stopping": a requeued job waits for the save."""
        def caught(signum, frame):
            if not self.caught and self.hold:
                self.hold.stopping()
            self.caught = signum

        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, caught)
        self.saved_at = time.monotonic()

    def resume(self, continue_from=None):
        """out_dir's newest valid checkpoint, else `continue_from` if it has a train state, else None (init_from)."""
        def choose():
            for tmp in glob.glob(os.path.join(self.c.out_dir, ".tmp-*")):  # a save that a kill cut short
                remove(tmp)
            latest = latest_valid_checkpoint(self.c.out_dir)
            return os.path.basename(latest) if latest else None

        if name := on_rank0(choose, self.process):  # each rank's out_dir: one that is not shared is said
            self.saved = os.path.join(self.c.out_dir, name)
            every_rank_sees(self.saved, self.process)
        elif continue_from and os.path.isfile(os.path.join(continue_from, TRAIN_STATE)):
            self.saved = continue_from
        return self.saved

    def after_step(self, model, optimizer, state, due, last=False):
        """At the step boundary `state.step`: write ckpt-STEP if `due` (the loop's interval, a phase's end), a signal
        reached any rank or ckpt_every_minutes passed on any rank's clock; else, at a multiple of keep_every,
        weights-only. -> True when a signal came: the run must stop (exit_code says how), unless at its `last` step."""
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

    def loss_error(self, loss, step):
        """The one line a run stops with when its loss is not finite."""
        return SystemExit(f"step {step}: loss is {loss}; stopping. The last good checkpoint is "
                          f"{(full_checkpoints(self.c.out_dir) or ['(none)'])[-1]}; lower lr or check the data.")

    def agree(self):
        """(a signal reached some rank, ckpt_every_minutes passed on some rank's clock), the same on every rank."""
        late = self.c.ckpt_every_minutes > 0 and time.monotonic() - self.saved_at >= 60 * self.c.ckpt_every_minutes
        if not dist.is_initialized():
            return bool(self.caught), late
        flags = torch.tensor([self.caught, late], dtype=torch.float32, device=self.process.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return tuple(bool(f) for f in flags.tolist())  # waits for the step, as the next step's batch copy would

    def save(self, path, model, optimizer, state):
        """Write `path`, then prune: a resume point with the optimizer (every rank's streams), else weights-only."""
        started = time.time()  # the phase of the last step done:
        saved = dict(step=state.step, tokens=state.tokens, phase=self.schedule.at(max(state.step - 1, 0)).name)
        if optimizer is not None:
            mine = dict(rng=rng_state(self.process.device), loss_acc=state.loss.item())
            ranks = [mine] * self.process.world  # every rank's entry, once gathered
            if dist.is_initialized():
                dist.all_gather_object(ranks, mine)
            if bad := [r["loss_acc"] for r in ranks if not math.isfinite(r["loss_acc"])]:  # not yet checked by a log
                raise self.loss_error(bad[0], state.step)
            saved.update(loader=state.loader, loss_steps=state.loss_steps, ranks=ranks)

        def write():
            save_checkpoint(path, model, optimizer, saved, self.c, self.schedule)
            prune(self.c.out_dir, self.c.max_ckpts, self.c.keep_every, self.schedule.starts[1:])

        on_rank0(write, self.process)  # also the barrier: no rank reads the checkpoint before it is complete
        every_rank_sees(path, self.process)
        if optimizer is not None:
            self.saved, self.saved_at = path, time.monotonic()
        self.written.append(time.time() - started)


def every_rank_sees(path, process):
    """Each rank checks (sizes only) `path`, which rank 0 wrote: a node that cannot see it would resume elsewhere."""
    if not dist.is_initialized():
        return
    views = [None] * process.world
    dist.all_gather_object(views, (socket.gethostname(), checkpoint_problem(path, checksums=False)))
    if blind := [f"rank {r} on {host} ({problem})" for r, (host, problem) in enumerate(views) if problem]:
        raise SystemExit(f"not every rank can read checkpoint {path}: {', '.join(blind)}. out_dir must be on a "
                         "filesystem shared by all nodes: rank 0 writes the checkpoints, every rank resumes from them.")


def check_start(c, meta, first_step):
    """At step 0, what the run `c` writes and starts from: out_dir, init_from, or the model of the run it resumes (its
    positions for seq_len); a warning where a run of later phases (from `first_step`) would replay the data."""
    check_out_dir(c.out_dir, "out_dir")
    # Resuming, init_from is not read; that this is the run out_dir holds is checked under the hold (Checkpointer).
    resuming = glob.glob(os.path.join(c.out_dir, "ckpt-*"))
    if c.init_from != "scratch" and not resuming:
        check_init_from(c.init_from, meta, c.data_dir, c.seq_len)
    if (first_step and not resuming and not c.skip_tokens and int(os.environ.get("RANK", 0)) == 0
            and not os.path.isfile(os.path.join(c.init_from, TRAIN_STATE))):
        print(f"warning: {c.init_from} has no train state, so the data position restarts at the stream's beginning "
              f"and run_phases={c.run_phases!r} replays the data of the phases before it. If those phases trained on "
              f"this data_dir with this data_seed, pass --skip_tokens={first_step * c.global_batch_size * c.seq_len} "
              f"(where the uninterrupted run stands at step {first_step})", file=sys.stderr)
    for path in resuming:  # the run's model (any checkpoint of it): a seq_len changed on resume must fit it too
        try:
            config = hf.load_config(ModernBertConfig, path)
        except (OSError, ValueError):
            continue  # a damaged checkpoint: resume warns and skips it
        check_seq_len(config, c.seq_len, "a new out_dir", f"the run in {c.out_dir}'s ")
        break


def check_init_from(path, meta, data_dir, seq_len):
    """init_from is a readable, intact checkpoint directory with the data's tokenizer and positions for seq_len."""
    if not os.path.isdir(path):
        raise SystemExit(f"init_from={path!r} is neither 'scratch' nor a checkpoint directory "
                         "(edit the path at the top of the config)")
    if os.path.isfile(os.path.join(path, MANIFEST)) and (problem := checkpoint_problem(path, train_state=False)):
        raise SystemExit(f"init_from={path} is damaged: {problem}. Copy it again, or use another checkpoint.")
    config = checkpoint_config(path, f"init_from={path}")
    with user_error(f"init_from={path}"):
        open(hf.weights_file(path), "rb").close()
    check_seq_len(config, seq_len, f"a checkpoint with {seq_len} positions or more", f"init_from={path}'s ")
    fix = f"prepare the data with the checkpoint's tokenizer: python data.py --tokenizer {path}"
    check_vocab(meta["vocab_size"], config, f"the tokenizer of {data_dir}", path, fix)
    tok = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tok) and meta.get("tokenizer_sha256") and sha256(tok) != meta["tokenizer_sha256"]:
        raise SystemExit(f"tokenizer mismatch: {tok} differs from the one {data_dir} was prepared with; {fix}")


def checkpoint_config(path, where):
    """-> the ModernBertConfig of the checkpoint `path`, or one line, beginning with `where`, that says why not."""
    with user_error(where):
        return hf.load_config(ModernBertConfig, path)
