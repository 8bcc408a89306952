"""support/threads.py: CPU threads follow the CPUs this process may use (affinity, a cgroup's quota) and the load of
the other processes on them; a thread count the user set wins, and compiled code keeps one. Its speed beside other
jobs is measured by tests/bench_share.py, not here."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from support import threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def said(before="", after="", env=None, prefix=()):
    """The start-up line's words for the threads of a fresh process that imports support.threads (as the scripts do
    first), runs `before`, then threads.setup."""
    code = (f"import torch; from support import threads; {before or 'pass'}; "
            f"threads.setup(torch.device('cpu'){after}); print(threads.describe(''))")
    r = subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**ENV, **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def torch_default():
    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True,
                       text=True, env=ENV)
    return int(r.stdout)


def test_the_start_up_line_names_the_threads_and_a_users_setting_wins():
    usable = min(threads.usable_cpus(), torch_default())  # torch's default counts physical cores, not hyperthreads
    n, shown = re.fullmatch(r"(\d+) CPU threads? \((\d+) usable, fewer while other processes load them\)",
                            said()).groups()
    assert int(shown) == usable and 1 <= int(n) <= usable
    assert said(env={"OMP_NUM_THREADS": "1"}) == "1 CPU thread (OMP_NUM_THREADS=1)"
    if torch_default() > 1:
        assert said("torch.set_num_threads(1)") == "1 CPU thread (torch.set_num_threads)"
    assert said(after=", compiled=True") == f"{usable} CPU thread{'s' * (usable > 1)} ({usable} usable, fixed: compiled)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_threads_follow_the_affinity_mask():
    assert said(prefix=["taskset", "-c", "0"]).startswith("1 CPU thread (1 usable")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpu"),
                    reason="needs root and a cgroup v1 cpu controller to make a group with a quota")
def test_threads_follow_a_cgroup_quota():
    group = f"/sys/fs/cgroup/cpu/clm_detour_test_{os.getpid()}"
    os.mkdir(group)
    try:
        with open(f"{group}/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        with open(f"{group}/cpu.cfs_quota_us", "w") as f:
            f.write("100000")  # one CPU
        enter = f"echo $$ > {group}/cgroup.procs && exec \"$@\""
        assert said(prefix=["sh", "-c", enter, "sh"]).startswith("1 CPU thread (1 usable")
    finally:
        os.rmdir(group)


@pytest.mark.alone
@pytest.mark.skipif(min(len(os.sched_getaffinity(0)), torch_default()) < 2, reason="needs 2 usable CPUs")
def test_beside_busy_processes_one_thread_then_all_again():
    x = torch.randn(256, 256)
    before = torch.get_num_threads()

    def work_until(n, seconds):
        """Ops and follow() until the count is n (or the time is up) -> the count."""
        until = time.monotonic() + seconds
        while time.monotonic() < until and torch.get_num_threads() != n:
            (x @ x).sum()
            threads.follow()
        return torch.get_num_threads()

    try:
        torch.set_num_threads(threads.DEFAULT)  # as a fresh process has it: not a count the user set
        threads.setup(torch.device("cpu"))
        usable = threads.usable
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(min(2 * usable, 8))]
        try:
            loaded = work_until(1, 10)
        finally:
            for b in busy:
                b.kill()
                b.wait()
        quiet = work_until(usable, 10)
    finally:  # the tests after this one keep their thread count
        threads.following = False
        torch.set_num_threads(before)
    assert (loaded, quiet) == (1, usable)
