"""
One writer per output directory (train.py's out_dir, eval.py's and cka.py's --out): an exclusive flock on DIR/.lock.

The kernel drops the flock when the process ends, however it ends (SIGKILL, the OOM killer): the same command run again
after a crash needs no manual step. The file says who holds it, whether it is stopping, and a heartbeat, so that a
second run is refused at once, naming the holder, and a requeued job tells a live holder from a dying or lost one:
  - stopping (train.py caught SIGTERM and is writing its last checkpoint): wait for it, then resume from it;
  - silent (its heartbeat has not moved for STALE seconds on this side's clock: its node is lost or frozen): wait
    for the filesystem to drop its lock;
each wait at most WAIT seconds. A process holds a directory once, until it exits, however often it asks.

What this needs of the filesystem: flock shared by every node. Local disks: yes. NFS (flock becomes a POSIX lock
the server arbitrates): yes, unless mounted `nolock` or `local_lock=flock|all`; a lost client's lock lasts until the
server's lease expires (NFSv4: 90 s, within the wait) or, on NFSv3, until that node reboots: the refusal then says
to remove DIR/.lock. Lustre: `-o flock` (with `-o localflock` only one node's processes see each other; with
neither, the run warns that nothing guards its directory and goes on). BeeGFS: tuneUseGlobalFileLocks. POSIX locks
belong to a process, not to an open file: this process must never open and close DIR/.lock elsewhere, which on NFS
would drop its lock. So the lock is fcntl.flock on the descriptor that carries the record, not filelock's (which
lends its descriptor to one callback at the take, where the heartbeat writes through it for the whole run).
"""

import errno
import fcntl
import json
import math
import os
import socket
import sys
import threading
import time

from support.processes import on_rank0
from support.files import open_fd, read_json

LOCK = ".lock"
BEAT = 30.0  # seconds between heartbeats
STALE = 120.0  # a heartbeat that has not moved for this long, on the reader's clock, is a lost holder's
WAIT = 600.0  # the longest wait for a stopping or lost holder: a Large checkpoint on a slow filesystem, or a lease
RECORD = 1024  # bytes: the record, padded with spaces and rewritten in place, so that a reader never finds it empty
FIELDS = {"host": str, "pid": int, "command": str, "since": str, "state": str, "beat": (int, float)}  # the record's
UNNAMED = 5.0  # seconds a held lock file may name no holder (its holder dies before its first record) before a refusal
held = {}  # directory (real path) -> this process's Hold


class Hold:
    """This process's hold on a directory: the open, locked .lock file, rewritten with each heartbeat."""

    def __init__(self, fd):
        # The heartbeat and stopping() both write, stopping() also from a signal handler mid-write: a reentrant lock.
        self.fd, self.writing, self.failed = fd, threading.RLock(), False
        command = " ".join(sys.argv)
        self.info = dict(host=socket.gethostname()[:100], pid=os.getpid(),
                         command=command[:80] + "..." * (len(command) > 80),
                         since=time.strftime("%Y-%m-%d %H:%M:%S %Z"), state="running")
        os.ftruncate(fd, RECORD)  # first: once written (and synced), the record is the whole file, a longer one's too
        self.write()
        threading.Thread(target=self.beat, daemon=True).start()

    def write(self):
        """Rewrite the record in place; a failed write (full disk, stale NFS handle) is said once: the run goes on."""
        record = json.dumps({**self.info, "beat": time.time()}).ljust(RECORD).encode()
        try:
            with self.writing:
                os.pwrite(self.fd, record, 0)
                os.fsync(self.fd)  # so that another node reads it (NFS: close-to-open)
        except OSError as e:
            if not self.failed:
                print(f"warning: cannot write the output directory's lock file ({e}); the run goes on", file=sys.stderr)
            self.failed = True

    def beat(self):
        while True:
            time.sleep(BEAT)
            self.write()

    def stopping(self):
        """Say that this run is writing its last checkpoint: a requeued job waits for it instead of refusing."""
        self.info["state"] = "stopping"
        self.write()


def holder(path):
    """The lock file `path`'s record, or {} if it names no holder (empty, cut, too long, not JSON, other shape)."""
    try:
        info = read_json(path, dict, RECORD)
    except (OSError, ValueError):
        return {}
    named = all(isinstance(info.get(k), t) and not isinstance(info[k], bool) for k, t in FIELDS.items())
    return info if named and info["state"] in ("running", "stopping") and math.isfinite(info["beat"]) else {}


def waiting_for(info, seen, now, where, what):
    """A holder's record, seen at `now` (on this side's clock; `seen` keeps its heartbeat's moves between looks) ->
    (who it is, why this run may wait: "stopping", "silent" or "watched", in words); a live holder is a SystemExit."""
    seen.pop("unreadable", None)
    if info["beat"] != seen.get("beat"):  # its first sight, or a move
        seen["moves"], seen["beat"], seen["moved"] = seen.get("moves", -1) + 1, info["beat"], now
    who = f"pid {info['pid']} on {info['host']} (`{info['command']}`, since {info['since']})"
    age = time.time() - info["beat"]  # by its clock against ours: a first guess only
    if info["state"] == "stopping":
        return who, "stopping", "stopping: it is writing its last checkpoint"
    if age < STALE or seen["moves"]:
        raise SystemExit(f"{where} is in use by {who}: one run writes a directory at a time. Wait for it (or stop it: "
                         f"kill -TERM {info['pid']} on {info['host']}, or scancel its job), or choose another {what}.")
    if now - seen["moved"] > STALE:
        return who, "silent", f"silent for {now - seen['moved']:.0f} s: its node may be lost"
    return who, "watched", f"its heartbeat {age:.0f} s old by its clock (lost, or its clock is not ours)"


def take(directory, what, check=lambda: None):
    """-> a Hold on `directory` (made if missing), or None where the filesystem has no locks (with a warning); a
    SystemExit naming the holder if another run holds it. check(): what must hold of the directory for this run,
    run once it is held and before its record is written: a refusal there leaves the lock file as it was."""
    key = os.path.realpath(directory)
    if key in held:
        return held[key]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    try:
        fd = open_fd(path, os.O_RDWR | os.O_CREAT)
    except PermissionError as e:
        raise SystemExit(f"{what}={directory}: cannot open {path} ({e.strerror}): another user's run left it; ask "
                         f"them to make it group-writable, or choose another {what}") from None
    gone = (f"If that process is gone (a lost node whose lock outlived it, as on NFSv3), remove {path} and re-run; "
            f"else wait for it, or choose another {what}.")
    started, said, seen = time.monotonic(), None, {}  # seen: on this clock, when the record was first unreadable,
    while True:  # its last heartbeat and when that last moved
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.close(fd)
            print(f"warning: {what}={directory}: its filesystem has no file locks ({e.strerror}), so nothing stops a "
                  "second run from writing there too (Lustre: mount with -o flock)", file=sys.stderr)
            check()
            return None
        now, info = time.monotonic(), holder(path)
        if not info and now - seen.setdefault("unreadable", now) > UNNAMED:  # it died before writing its record
            raise SystemExit(f"{what}={directory} is held by a process that {path} does not name. {gone}")
        if info:
            who, state, why = waiting_for(info, seen, now, f"{what}={directory}", what)
            if said != state:
                said = state
                print(f"{what}={directory} is held by {who}, {why}; waiting up to {WAIT / 60:.0f} minutes for it",
                      file=sys.stderr, flush=True)
            if now - started > WAIT:
                raise SystemExit(f"{what}={directory} is still held by {who} after {WAIT / 60:.0f} minutes. {gone}")
        time.sleep(1.0)
    if said:
        print(f"{what}={directory}: its holder is gone after {time.monotonic() - started:.0f} s; going on")
    try:
        check()
    except SystemExit:
        os.close(fd)  # and the lock with it
        raise
    held[key] = Hold(fd)
    return held[key]


def hold(directory, process, what="--out", check=lambda: None):
    """Hold `directory` for this run, before any work: rank 0 takes it (check() under it, see take), every rank gets
    the outcome. -> the Hold on rank 0 (None elsewhere, or where the filesystem has no locks)."""
    on_rank0(lambda: take(directory, what, check) and None, process)  # only the outcome goes to the other ranks
    return held.get(os.path.realpath(directory)) if process.rank == 0 else None
