"""support/threads.py: CPU threads follow the CPUs this process may use (affinity, a cgroup's quota) and the load of
the other processes on them; a thread count the user set wins. Its speed beside other jobs is measured by
tests/bench_share.py, not here."""

import os
import subprocess
import sys
import time

import pytest
import torch

from support import threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE = "import torch; from support import threads; threads.setup(torch.device('cpu')); print(threads.describe(''))"


def said(env=None, prefix=()):
    r = subprocess.run([*prefix, sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True,
                       env={**{k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}, **(env or {})})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_start_up_line_names_the_threads_and_a_users_setting_wins():
    n = len(os.sched_getaffinity(0))
    assert said().startswith(f"{n} CPU thread") and f"({n} usable, fewer while other processes load them)" in said()
    assert said({"OMP_NUM_THREADS": "1"}) == "1 CPU thread (OMP_NUM_THREADS=1)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_threads_follow_the_affinity_mask():
    assert said(prefix=["taskset", "-c", "0"]).startswith("1 CPU thread (1 usable")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpu"),
                    reason="needs root and a cgroup v1 cpu controller to make a group with a quota")
def test_threads_follow_a_cgroup_quota(tmp_path):
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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or "OMP_NUM_THREADS" in os.environ,
                    reason="needs 2 CPUs and no OMP_NUM_THREADS")
def test_beside_busy_processes_one_thread_then_all_again():
    cpus = len(os.sched_getaffinity(0))
    x = torch.randn(256, 256)

    def work(seconds):
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            (x @ x).sum()
            threads.follow()
        return torch.get_num_threads()

    threads.setup(torch.device("cpu"))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cpus)]
    try:
        loaded = work(2.5)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    try:
        quiet = work(2.5)
    finally:  # the tests after this one keep their thread count
        threads.following = False
        torch.set_num_threads(cpus)
    assert (loaded, quiet) == (1, cpus)
