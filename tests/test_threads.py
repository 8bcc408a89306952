"""support/threads.py: CPU threads follow the CPUs this process may use (affinity, a cgroup's quota) and the others'
load on them; a count the user set wins, compiled code keeps one. The load is faked, or made and measured by the test,
so that what else runs changes nothing. Its speed beside other jobs: results/cpu-2026-11-28/README.md."""

import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from support import threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def said(before="", then="", env=None, prefix=()):
    """The start-up line's words for the threads of a fresh process that imports support.threads (as the scripts do
    first), runs `before`, then threads.setup, then `then`."""
    code = (f"import torch; from support import threads; {before or 'pass'}; "
            f"threads.setup(torch.device('cpu')); print(threads.describe('')); {then or 'pass'}")
    r = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**ENV, **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_start_up_line_names_the_threads_and_a_users_setting_wins():
    # torch's own count before setup, the line, compiled code's line (a count setup set is not the user's), then the
    # line after the user's torch.set_num_threads
    cpu = "torch.device('cpu')"
    default, line, compiled, users = said(
        "print(torch.get_num_threads())", f"threads.setup({cpu}, compiled=True); print(threads.describe('')); "
        f"torch.set_num_threads(1); threads.setup({cpu}); print(threads.describe(''))").split("\n")
    usable = min(threads.usable_cpus(), int(default))  # torch's default counts physical cores, not hyperthreads
    n, shown = re.fullmatch(r"(\d+) CPU threads? \((\d+) usable, fewer while other processes load them\)",
                            line).groups()
    assert int(shown) == usable and 1 <= int(n) <= usable
    assert compiled == f"{usable} CPU thread{'s' * (usable > 1)} ({usable} usable, fixed: compiled)"
    if usable > 1:
        assert users == "1 CPU thread (torch.set_num_threads)"
    assert said(env={"OMP_NUM_THREADS": "1"}) == "1 CPU thread (OMP_NUM_THREADS=1)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_usable_cpus_follow_the_affinity_mask():
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})  # this thread's mask, as taskset -c sets a process's
    try:
        assert threads.usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, mask)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpu"),
                    reason="needs root and a cgroup v1 cpu controller to make a group with a quota")
def test_threads_follow_a_cgroup_quota():
    group = f"/sys/fs/cgroup/cpu/clm_detour_test_{os.getpid()}"
    os.makedirs(f"{group}/job")  # the quota on its parent, as a container's group holds its processes' groups
    try:
        for name, value in (("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "100000")):  # one CPU
            with open(f"{group}/{name}", "w") as f:
                f.write(value)
        enter = f"echo $$ > {group}/job/cgroup.procs && exec \"$@\""
        assert said(prefix=["sh", "-c", enter, "sh"]).startswith("1 CPU thread (1 usable")
    finally:
        os.rmdir(f"{group}/job")
        os.rmdir(group)


def test_the_count_is_the_cpus_the_others_left_free(monkeypatch):
    """Faked readings of 4 CPUs, 3 of them usable: at start-up the processes running now, then every second the
    CPU seconds the others took over the last one (all busy time less this process's own), rounded, at least 1."""
    before = torch.get_num_threads()
    clock, busy, own = [100.0], [0.0], [0.0]
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "usable_cpus", lambda: 3)
    monkeypatch.setattr(threads, "DEFAULT", 4)
    monkeypatch.setattr(threads, "USER", [])  # OMP_NUM_THREADS of the shell that runs the tests: not this process's
    monkeypatch.setattr(threads, "time", SimpleNamespace(monotonic=lambda: clock[0], process_time=lambda: own[0]))
    monkeypatch.setattr(threads, "busy_seconds", lambda cpus: busy[0] if cpus == {0, 1, 2, 3} else None)
    monkeypatch.setattr(threads, "running_now", lambda: 3)  # this process and 2 others, at start-up
    for name in ("on_cpu", "following", "usable", "fixed_by", "ours", "last"):  # what setup and follow set: restored
        monkeypatch.setattr(threads, name, getattr(threads, name))

    def second(others, mine, seconds=1.0):
        """`seconds` pass, the others busy for `others` CPU seconds, this process for `mine` -> the count after."""
        clock[0], busy[0], own[0] = clock[0] + seconds, busy[0] + others + mine, own[0] + mine
        threads.follow()
        return torch.get_num_threads()

    try:
        torch.set_num_threads(4)  # as a fresh process has it: not a count the user set
        threads.setup(torch.device("cpu"))
        assert threads.following and torch.get_num_threads() == 2  # 4 CPUs, 2 other processes running
        assert second(0.0, 2.0) == 2  # the first reading: nothing to compare with yet
        assert second(3.5, 0.5) == 1  # 4 - 3.5 = 0.5 free: at least one
        assert second(1.6, 2.0) == 2  # 2.4 free
        assert second(0.0, 0.3, seconds=0.5) == 2  # within the second: no new count
        assert second(0.0, 3.0, seconds=0.5) == 3  # over the last 1 s (0.0 + 0.0): 4 free, 3 usable
        assert second(4.0, 2.0, seconds=2.0) == 2  # 2 s: the others took 2 CPUs
    finally:  # the tests after this one keep their thread count
        torch.set_num_threads(before)


def test_busy_seconds_counts_a_process_that_spins():
    """/proc/stat's busy time on this process's CPUs covers the CPU time of a process the test makes spin there (what
    the rest of the machine does only adds to it), and no more than those CPUs had."""
    cpus = os.sched_getaffinity(0)
    started, busy = time.monotonic(), threads.busy_seconds(cpus)  # before the spinner: its whole CPU time is after
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spun = 0.0
        while spun < 0.5 and time.monotonic() - started < 120:  # a busy machine gives it its turns later
            time.sleep(0.1)
            with open(f"/proc/{spinner.pid}/stat") as f:
                utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
            spun = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        busy, wall = threads.busy_seconds(cpus) - busy, time.monotonic() - started
    finally:
        spinner.kill()
        spinner.wait()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    # Per CPU, /proc/stat truncates each of six fields to a tick at each read, the kernel charges time a tick at a time,
    # and a VM's stolen time comes in late chunks (10 ticks in 0.8 s seen): on CPUs busy all along (the tests beside
    # this one), busy passes CPUs x wall by that much, while counting one CPU too many would add a whole wall.
    assert spun >= 0.5 and 0.95 * spun - 2 * tick <= busy <= len(cpus) * (1.25 * wall + 7 * tick), (spun, busy, wall)
