"""
CPU threads that follow the CPUs this process can use, for train.py, eval.py and cka.py on CPU.

PyTorch's CPU ops run on an OpenMP team (a thread per core) that meets at a barrier after every op, and the demo's
small model runs thousands of short ops a step. A thread that arrives first spins there (~300,000 pause instructions,
libgomp's default) before it sleeps: beside other jobs, the thread it waits for is off its core and the spinner burns
its own time slice, so the run takes many times its fair share of the machine. Waiting passively
(OMP_WAIT_POLICY=PASSIVE) still pays a wake-up per op; one thread has no barrier at all.

So: as many threads as the usable CPUs that the other processes leave free, re-counted every second (all of them on
a quiet machine, one beside busy jobs); a count the user set is left alone: OMP_NUM_THREADS=2 repeats a run bit for bit.
"""

import math
import os
import time
from pathlib import Path, PurePosixPath

import torch

USER = [k for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if os.environ.get(k)]
INTERVAL = 1.0  # seconds between counts: ~100 clock ticks per CPU, and a fraction of a ms to read


def usable_cpus():
    """The CPUs this process may run on: its affinity mask (taskset, a cpuset), capped by the cgroup CPU quota of
    a container (docker --cpus), which the affinity mask does not show."""
    return min([len(os.sched_getaffinity(0))] + [max(1, math.floor(quota)) for quota in cgroup_quotas()])


def cgroup_quotas():
    """The CPU quotas, in CPUs, of this process's cgroup and its parents: v2's cpu.max holds "quota period", v1's
    cpu.cfs_quota_us and cpu.cfs_period_us one each."""
    try:
        entries = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
    except OSError:
        return []
    quotas = []
    for _, controllers, path in entries:
        if controllers and "cpu" not in controllers.split(","):  # v2's line names no controllers
            continue
        root, files = (f"/sys/fs/cgroup/{controllers}", ("cpu.cfs_quota_us", "cpu.cfs_period_us")) if controllers \
            else ("/sys/fs/cgroup", ("cpu.max",))
        for group in [path, *map(str, PurePosixPath(path).parents)]:  # the group, then its parents up to the root
            try:
                quota, period = " ".join(Path(root + group, name).read_text() for name in files).split()
                if quota not in ("max", "-1"):
                    quotas.append(int(quota) / int(period))
            except (OSError, ValueError):
                pass
    return quotas


def busy_seconds(cpus):
    """CPU seconds spent so far on `cpus` by anything (/proc/stat: all but idle and iowait; steal included)."""
    total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(t) for t in ticks[:8]]
                total += sum(ticks) - ticks[3] - ticks[4]
    return total / os.sysconf("SC_CLK_TCK")


def running_now():
    """The processes running or ready to run on the machine at this instant, this one included (/proc/stat)."""
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))


# This process's state: whether the count follows the load, the usable CPUs, the last count of the CPUs' time.
DEFAULT = torch.get_num_threads()  # torch's own count (the machine's physical cores: no hyperthreads), or the caller's
on_cpu, following, usable, fixed_by, ours, last = False, False, None, None, None, None


def setup(device, compiled=False):
    """Before the first op, on CPU: the count above, re-counted by follow(); a count the user set (OMP_NUM_THREADS,
    MKL_NUM_THREADS, torch.set_num_threads before this call) stays. Compiled code keeps inductor's: all usable."""
    global on_cpu, following, usable, fixed_by, last
    on_cpu, usable, last = device.type == "cpu", min(usable_cpus(), DEFAULT), None
    fixed_by = (f"{USER[0]}={os.environ[USER[0]]}" if USER else "torch.set_num_threads"
                if torch.get_num_threads() not in (DEFAULT, ours) else "torch.compile" if compiled else None)
    following = on_cpu and not fixed_by and os.path.exists("/proc/stat")
    if on_cpu and fixed_by in (None, "torch.compile"):
        free = len(os.sched_getaffinity(0)) - running_now() + 1 if following else usable  # others running right now
        use(max(1, min(usable, free)))


def use(n):
    global ours
    ours = n
    if n != torch.get_num_threads():
        torch.set_num_threads(n)


def describe(before=", "):
    """The start-up line's words for the threads on CPU (", 2 CPU threads (2 usable, ...)"); "" on a GPU."""
    if not on_cpu:
        return ""
    n = torch.get_num_threads()
    said = f"{before}{n} CPU thread{'s' * (n > 1)}"
    if fixed_by and fixed_by != "torch.compile":
        return f"{said} ({fixed_by})"
    return f"{said} ({usable} usable{', fewer while other processes load them' if following else ', fixed: compiled'})"


def follow():
    """Once per step, on the thread that runs the ops (OpenMP's thread count is its caller's): every INTERVAL, the CPUs
    the other processes left free over the last one (/proc/stat's busy time on this process's CPUs less its own)."""
    global last
    if not following:
        return
    now = time.monotonic()
    if last and now - last[0] < INTERVAL:
        return
    cpus = os.sched_getaffinity(0)
    sample = (now, busy_seconds(cpus), time.process_time())  # this process's CPU seconds
    if last:
        others = max(0.0, (sample[1] - last[1]) - (sample[2] - last[2])) / (now - last[0])  # CPUs kept busy
        use(max(1, min(usable, round(len(cpus) - others))))
    last = sample
