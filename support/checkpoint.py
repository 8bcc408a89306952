"""
The checkpoint directory: out_dir/ckpt-STEP/ (and out_dir/final/) = the Hugging Face files
(config.json, model.safetensors, tokenizer) + train_state.pt (optimizer, step, tokens, data
position, every rank's random streams and loss sums) + manifest.json.

Everything is written to a temporary directory, the manifest (size and sha256 of every other
file) last, synced to disk, then renamed: a kill at any moment leaves the previous checkpoints
as they were, and a checkpoint damaged later (a truncated copy, a bad disk) fails its manifest
and is skipped on resume. train.py decides when to write and where to resume; this file only
knows the format.
"""

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import sys

import torch
from safetensors import SafetensorError

from support.tokenizer import TOKENIZER_FILES

MANIFEST = "manifest.json"


def save_checkpoint(path, model, optimizer, state, c):
    """Write the checkpoint directory `path`. If a write fails (a full disk, a quota) the partial copy is
    removed, the previous checkpoints stay intact, and the run stops saying how much space it needs."""
    out_dir = os.path.dirname(path)
    tmp = os.path.join(out_dir, ".tmp-" + os.path.basename(path))
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            src = os.path.join(c.data_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(tmp, name))
        torch.save({**state, "optimizer": optimizer.state_dict(), "config": dataclasses.asdict(c)},
                   os.path.join(tmp, "train_state.pt"))
        # Hashing reads every file back: a few seconds for a Large checkpoint (about 5 GB with the optimizer).
        manifest = {}
        for name in sorted(os.listdir(tmp)):
            file = os.path.join(tmp, name)
            manifest[name] = {"bytes": os.path.getsize(file), "sha256": sha256(file)}
            fsync(file)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        fsync(os.path.join(tmp, MANIFEST))
        fsync(tmp)
        shutil.rmtree(path, ignore_errors=True)  # "final" of a re-run, or a damaged copy of this step
        os.replace(tmp, path)
        fsync(out_dir)
    except (OSError, RuntimeError, SafetensorError) as e:  # how open(), torch.save and safetensors report it
        shutil.rmtree(tmp, ignore_errors=True)
        moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        need = sum(t.numel() * t.element_size() for t in [*model.parameters(), *moments])
        free = shutil.disk_usage(out_dir).free
        raise SystemExit(f"could not write checkpoint {path}: {e}. A checkpoint needs about {need / 2 ** 30:.3g} GiB "
                         f"and {out_dir} has {free / 2 ** 30:.3g} GiB free. The previous checkpoints are intact: free "
                         "some space (or lower max_ckpts, or move out_dir) and re-run the same command to resume.")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def fsync(path):
    """Flush a file, or a directory's entries, to disk (a rename is only durable once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_problem(path, checksums=True):
    """What is wrong with the checkpoint directory `path`, or None if every file its manifest lists is
    there with its size and (if checksums) its sha256."""
    if not os.path.isdir(path):
        return "no such directory"
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return f"no {MANIFEST}: it was not written completely"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, want in manifest.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {want['bytes']} (truncated?)"
        if checksums and sha256(file) != want["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def step_checkpoints(out_dir):
    """The ckpt-STEP directories in out_dir, complete or not, oldest first."""
    found = [p for p in glob.glob(os.path.join(out_dir, "ckpt-*")) if re.fullmatch(r"ckpt-\d+", os.path.basename(p))]
    return sorted(found, key=lambda p: int(p.rsplit("-", 1)[1]))


def latest_valid_checkpoint(out_dir):
    """The newest checkpoint in out_dir that passes its manifest (None if out_dir has none). Each damaged
    newer one gets a warning; if all are damaged the run stops rather than start over silently."""
    damaged = []
    for path in reversed(step_checkpoints(out_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"warning: checkpoint {path} is damaged ({problem}); trying the one before it", file=sys.stderr)
        damaged.append(path)
    if damaged:
        raise SystemExit(f"no valid checkpoint in {out_dir}: {', '.join(damaged)} are damaged (see the warnings). "
                         "Restore one from a copy, or move them away to start over from init_from.")
    return None


def trim_metrics(path, step):
    """Keep the records of metrics.jsonl up to `step`, the resume point: a killed run may have logged
    past its last checkpoint, or died in the middle of a line."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


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
