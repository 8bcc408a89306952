"""
One writer per output directory. A run holds its directory (train.py's out_dir, eval.py's and cka.py's --out)
with an exclusive flock on DIR/.lock, which the kernel drops when the process ends, however it ends (exit,
SIGKILL, the OOM killer): the same command run again after a crash needs no manual step. The file says who
holds it (host, pid, command, since when), whether it is stopping, and a heartbeat, so that a second run is
refused at once in one line naming the holder, and a requeued job tells a live holder from a dying or lost one:
  - stopping (train.py caught SIGTERM and is writing its last checkpoint): wait for it, then resume from it;
  - silent (no heartbeat for STALE seconds: its node is lost or frozen): wait for the filesystem to drop its lock;
each wait at most WAIT seconds, said when it starts. Under torchrun rank 0 holds the directory for the job and
every rank gets the same answer.

What this needs of the filesystem: flock shared by every node that runs against it. Local disks: yes. NFS (Linux
clients turn flock into POSIX locks, which the server arbitrates): yes; a lost client's lock lasts until the
server's lease expires (NFSv4: 90 s by default, within the wait) or, on NFSv3, until that node reboots: the
refusal then says to remove DIR/.lock. Lustre: mounted with `-o flock`; with `-o localflock` only processes on
one node see each other's lock; with neither, flock fails and the run warns that nothing guards its directory,
then goes on unguarded.
"""

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time

from support.distributed import on_rank0

LOCK = ".lock"
BEAT = 30.0  # seconds between heartbeats
STALE = 120.0  # a holder silent this long is taken for lost (four beats missed; clocks of a cluster agree to far less)
WAIT = 600.0  # the longest wait for a stopping or lost holder: a Large checkpoint on a slow filesystem, or a lease


class Hold:
    """This process's hold on a directory: the open, locked .lock file, rewritten with each heartbeat."""

    def __init__(self, fd):
        self.fd, self.writing = fd, threading.Lock()  # the heartbeat thread and stopping() both rewrite the file
        command = " ".join(sys.argv)
        self.info = dict(host=socket.gethostname(), pid=os.getpid(), command=command[:80] + "..." * (len(command) > 80),
                         since=time.strftime("%Y-%m-%d %H:%M:%S"), state="running")
        self.write()
        threading.Thread(target=self.beat, daemon=True).start()

    def write(self):
        with self.writing:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps({**self.info, "beat": time.time()}).encode(), 0)
            os.fsync(self.fd)  # so that another node reads it (NFS: close-to-open)

    def beat(self):
        while True:
            time.sleep(BEAT)
            self.write()

    def stopping(self):
        """Say that this run is writing its last checkpoint: a requeued job waits for it instead of refusing."""
        self.info["state"] = "stopping"
        self.write()


def holder(path):
    """What the lock file at `path` says of its holder ({} while it is being rewritten)."""
    try:
        with open(path) as f:
            return json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}


def take(directory, what):
    """-> a Hold on `directory` (made if missing), or None where the filesystem has no locks (with a warning); a
    SystemExit naming the holder if another run holds it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    started, waiting = time.time(), None  # why this run waits, once it does
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if waiting:
                print(f"{what}={directory}: its holder is gone after {time.time() - started:.0f} s; going on")
            return Hold(fd)
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.close(fd)
            print(f"warning: {what}={directory}: its filesystem has no file locks ({e.strerror}), so nothing stops a "
                  "second run from writing there too (Lustre: mount with -o flock)", file=sys.stderr)
            return None
        info = holder(path)  # {} for an instant while the holder rewrites it
        if not info and time.time() - started > 5:
            raise SystemExit(f"{what}={directory} is in use by another process ({path} does not say which): one run "
                             f"writes a directory at a time. Wait for it to end, or choose another {what}.")
        if info:
            who = f"pid {info['pid']} on {info['host']} (`{info['command']}`, since {info['since']})"
            silent = time.time() - info["beat"]
            why = ("stopping: it is writing its last checkpoint" if info["state"] == "stopping" else
                   f"silent for {silent:.0f} s: its node may be lost" if silent > STALE else None)
            if why is None:
                raise SystemExit(f"{what}={directory} is in use by {who}: one run writes a directory at a time. Wait "
                                 f"for it to end (or stop it: kill -TERM {info['pid']} on {info['host']}), or choose "
                                 f"another {what}.")
            if waiting is None:
                waiting = why
                print(f"{what}={directory} is held by {who}, {why}; waiting up to {WAIT / 60:.0f} minutes for it",
                      file=sys.stderr, flush=True)
            elif time.time() - started > WAIT:
                raise SystemExit(f"{what}={directory} is still held by {who}, {why}, after {WAIT / 60:.0f} minutes. "
                                 f"If that process is gone (a lost node whose lock outlived it, as on NFSv3), remove "
                                 f"{path} and re-run; else wait for it, or choose another {what}.")
        time.sleep(1.0)


def hold(directory, process, what="--out"):
    """Hold `directory` for this run, before any work: rank 0 takes it, every rank gets the outcome (a refusal is
    one line on rank 0). -> the Hold on rank 0 (None elsewhere, or where the filesystem has no locks)."""
    held = []
    on_rank0(lambda: held.append(take(directory, what)), process)
    return held[0] if held else None
