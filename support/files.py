"""
Reading and writing files that travel between people: two rules, kept here once, and where each file is checked.

Such files sit on shared filesystems where others can write, so every script reads and writes them by these rules:
- reading: only a regular file of a size such a file can have (a FIFO would block), and JSON only of the shape its
  reader expects; anything else is a ValueError that names the file, which the caller turns into its one line;
- writing: nothing is written, renamed or deleted through a symbolic link that the project did not make.

Where each file the project reads is checked (its reader says what); a bad or hostile one gets "one line": exit 1,
naming the file, the field and the fix, before any work, nothing on disk changed.
- config.json, model.safetensors, pytorch_model.bin: support/hf.py (weights_only).
- train_state.pt, manifest.json (one that fails marks its checkpoint damaged: the one before it is resumed, none left
  is one line, metrics.jsonl stays as it was): support/checkpoint.py. out_dir/config.json: support/config.py.
- progress.json: cka.py. meta.json, train.bin, val.bin, tokenizer.json's sha256: support/shards.py, then data.Loader
  checks each window's ids. tokenizer.json and its companions: support/tokenizer.py (then Hugging Face's parser).
- .lock: support/lock.py (a record of another shape names no holder).
- metrics.jsonl: support/metrics.py (a line that is no record is kept and skipped, with a warning).
- stored suite runs, task .jsonl/.tsv: support/suite.py, eval.py.
"""

import errno
import hashlib
import json
import math
import os
import shutil
import stat
import uuid
from contextlib import contextmanager

MAX_JSON = 1 << 28  # bytes: a tokenizer.json of a 250k vocabulary is about 20 MB; no JSON file of ours comes near
JSON_TYPES = {bool: "boolean", dict: "object", list: "array", str: "string", int: "number", float: "number"}


def read_bytes(path, limit):
    """The bytes of the regular file `path`, once it is no larger than `limit`; else a ValueError naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer, then is refused
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is {kind(path, st)}, not a file")
        if st.st_size > limit:
            raise ValueError(f"{path} has {st.st_size:,} bytes, more than such a file can hold ({limit:,})")
        data = open(fd, "rb", closefd=False).read(limit + 1)  # buffered: reads on until limit + 1 bytes or the end
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        raise ValueError(f"{path} has more than {limit:,} bytes, more than such a file can hold")
    return data


def read_json(path, shape=dict, limit=MAX_JSON):
    """The JSON value in `path`, once of type `shape` (dict or list); else a ValueError naming the file and it."""
    data = read_bytes(path, limit)
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{path} is not JSON this code reads: it is nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, shape):
        raise ValueError(f"{path} holds a JSON {JSON_TYPES.get(type(value), 'null')} where a JSON {JSON_TYPES[shape]} "
                         "is expected")
    return value


def json_lines(lines, path):
    """(line number, value) of each non-blank line of a JSONL file; a line that is not JSON: a SystemExit naming it."""
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than any record
                raise SystemExit(f"{path}:{n}: not a JSON line this code reads ({type(e).__name__}: {e})") from None


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def whole(value, lo=0, hi=1 << 63):
    """value is a JSON whole number in [lo, hi]: not a boolean, and not 768.0 either (our files write integers)."""
    return type(value) is int and lo <= value <= hi


def number(value, lo=-math.inf, hi=math.inf):
    """value is a finite JSON number in [lo, hi], not a boolean."""
    return (type(value) is int or type(value) is float and math.isfinite(value)) and lo <= value <= hi


@contextmanager
def user_error(where=""):
    """A bad input, as a library call reports it (OSError, ValueError) -> the one line a user reads: `where: why`."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise SystemExit(f"{where}: {e}" if where else str(e)) from None


# What a run writes lies in its output directory (out_dir, --out, a data set's folder): a path the user gave, a link
# included, is theirs. Inside it the project makes every entry itself, so a link found there was put there by someone
# else: a write through it would change the file it points to, anywhere this user (as root: anyone) may write. So a
# file is opened without following a link (O_NOFOLLOW), and a directory of the project's is one that it made (mkdir
# never follows a link) or found to be no link (lstat). A hard link is refused where a file is changed in place
# (appended to, a lock record); a rename replaces a name, never the file behind it. Not covered: a user who may
# rename the entries of an output directory while a run writes there could swap a directory for a link between a
# check and a write. Keep output directories writable by you, or by a group you trust, alone.


def refuse(path, what):
    """The one line for an entry at `path` that the project will not write, rename or delete through."""
    raise SystemExit(f"{path} is {what}, not a file this project made: nothing is written, renamed or deleted there. "
                     f"Remove it and re-run (if you did not put it there, someone who can write to "
                     f"{os.path.dirname(os.path.abspath(path))} did)")


def refuse_link(path):
    """Refuse a link at `path`: checked before work that ends in writing there."""
    if os.path.islink(path):
        refuse(path, f"a symbolic link to {os.readlink(path)}")


def kind(path, st):
    """What the entry at `path`, of lstat or fstat `st`, is, in words; None for a regular file of one name."""
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to {os.readlink(path)}"
    if not stat.S_ISREG(st.st_mode):
        return "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device or a socket"
    return f"a hard link (one of the {st.st_nlink} names of a file)" if st.st_nlink > 1 else None


def open_fd(path, flags):
    """A descriptor of the regular file `path` of one name, opened with `flags` (os.O_*; made if missing with
    os.O_CREAT): a link, a directory, a FIFO (opened without waiting for a reader) or a device there is refused."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)  # the umask decides the mode
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link (O_NOFOLLOW), a directory, a FIFO unread
            refuse(path, kind(path, os.lstat(path)))
        raise
    if what := kind(path, os.fstat(fd)):
        os.close(fd)
        refuse(path, what)
    return fd


def open_file(path, mode="w"):
    """`path` opened for writing as open(path, mode) would ("w", "wb": emptied; "a": appended to), once it is a
    regular file of one name (see open_fd). No O_TRUNC at the open: a hard link is refused before it is emptied."""
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else 0))
    if "w" in mode:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"}))


def replace_file(path, data):
    """Write the file `path` whole or not at all: `data` (str or bytes) into PATH.tmp, synced, renamed over `path`. A
    link there, which the rename would replace, is refused all the same: someone else writes in the directory."""
    refuse_link(path)
    remove(path + ".tmp")  # a killed write's
    with os.fdopen(open_fd(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def remove(path):
    """Delete the file or tree `path`, if any; a link there is refused, one inside the tree deleted itself (rmtree
    works through directory descriptors). What stays of a tree makes the rename that follows fail, with its line."""
    refuse_link(path)
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def fresh_dir(path):
    """-> `path`: an empty directory made now (what was there removed first, the folders above made if missing)."""
    remove(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    os.mkdir(path)
    return path


def make_dirs(root, path):
    """The directories from `root` (the user's path, made if missing) down to `path` below it, each made if missing;
    one there already must be a directory, not a link to one. -> path"""
    os.makedirs(root, exist_ok=True)
    here = root
    for part in os.path.relpath(path, root).split(os.sep):
        here = os.path.join(here, part)
        try:
            os.mkdir(here)
        except FileExistsError:
            st = os.lstat(here)
            if not stat.S_ISDIR(st.st_mode):
                refuse(here, kind(here, st) or "a file")
    return path


def check_out_dir(path, name="--out"):
    """The output location is a directory, or can be made one, that this user may write (a probe file is written
    and removed), and holds no link: checked before any work, so no result is lost at the end to a wrong path."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"{name}={path}: is a file, not a directory; give a directory path")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # where the directory will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise SystemExit(f"{name}={path}: {parent} is a file, not a directory; choose another path")
    probe = os.path.join(parent, f".write-test-{uuid.uuid4().hex}")
    try:
        os.close(open_fd(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"{name}={path} is not writable ({e.strerror}): choose a directory this user can write"
                         f"{', on a filesystem every node shares' if name == 'out_dir' else ''}") from None
    if os.path.isdir(path):  # a link in it is said now, not at the write that would meet it, hours in
        for entry in os.scandir(path):
            refuse_link(entry.path)
