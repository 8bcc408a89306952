"""A CPU run beside other jobs (not collected by pytest):

    python tests/bench_share.py                                  # ~10 minutes on 2 cores
    python tests/bench_share.py --busy 4 --runs 5 --variant OMP_NUM_THREADS=1 --variant OMP_WAIT_POLICY=PASSIVE
    python tests/bench_share.py --variant OMP_NUM_THREADS=2:quiet    # the code before support/threads.py, quiet only
    python tests/bench_share.py --apart --variant OMP_NUM_THREADS=2  # the busy processes as another user's jobs

`train.py configs/demo.py --tokens=60000` (the demo's model and batch), timed whole as a user waits for it
(start-up included), alone ("quiet") and beside --busy processes that each spin one core ("loaded"), --runs
times each, in turn. Each variant is the same command with environment variables added ("as is": none); one
ending in ":quiet" runs quiet only.

Fair share: a run that gets the share of the machine its threads would get among the busy ones. With C usable
CPUs (support/threads.py: affinity and cgroup quota) and the quiet time Q of the command as is (its median), C
threads among N + C runnable ones get C / (N + C) of the machine: fair = Q * (N + C) / C (3.0 Q for 4 busy
processes on 2 cores). The table gives each variant's quiet and loaded times (median, min-max), loaded / fair
(median, worst), and the CPUs the run kept busy (its CPU time / wall time): beside 4 busy processes one thread gets
2 / 5 = 0.40 of a CPU, the most a thread can get there; threads that meet at a barrier after every op get little
more, whatever their number (OpenMP splits each op evenly, so the op waits for the thread that is off its core).

Where the busy processes run matters. By default they share the run's session, as jobs started from one shell do.
Linux's autogroup scheduler (on where /proc/sys/kernel/sched_autogroup_enabled is 1, as on most desktops and login
nodes) shares the CPUs between sessions first, then between the threads of each session. With --apart the busy
processes run in a session of their own, as another user's jobs (another ssh login) do: under autogroup the two
sessions then share the machine, and fair = Q * C / max(C - N, C / 2) (2.0 Q for 4 busy processes on 2 cores).
(torchrun starts each worker in a session of its own, so its workers get a session's share each.)
"""

import argparse
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support.threads import usable_cpus  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# N processes that spin one core each: this one and the N - 1 it forks, in one process group (killed as one)
SPIN = "import os\nfor _ in range({}):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass"


def autogroup():
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return "on" if f.read().strip() == "1" else "off"
    except OSError:
        return "absent"


def timed(cmd, env):
    """-> (wall seconds, CPUs it kept busy on average: its CPU time / wall, the threads the start-up line names)."""
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    threads = re.search(r"\d+ CPU threads? \([^)]*\)", r.stdout)
    return wall, cpu / wall, threads[0] if threads else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy", type=int, default=4, help="processes spinning one core each beside the loaded runs")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=60_000)
    p.add_argument("--apart", action="store_true", help="the busy processes in a session of their own (see above)")
    p.add_argument("--variant", action="append", default=[], help="NAME=VALUE[,NAME=VALUE][:quiet]: environment added")
    args = p.parse_args()
    variants = {"as is": {}, **{v: dict(kv.split("=", 1) for kv in v.removesuffix(":quiet").split(","))
                                for v in args.variant}}
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    tmp = tempfile.mkdtemp(prefix="bench_share-")
    data = os.path.join(tmp, "data")
    subprocess.run([sys.executable, "data.py", "--demo", "domain", "--tokenizer", "bpe:4096", "--out", data],
                   cwd=ROOT, check=True, capture_output=True)
    cmd = lambda k: [sys.executable, "train.py", "configs/demo.py", f"--data_dir={data}",  # noqa: E731
                     f"--out_dir={os.path.join(tmp, f'run{k}')}", f"--tokens={args.tokens}", "--log_interval=1000"]
    times, said, k = {(v, load): [] for v in variants for load in ("quiet", "loaded")}, {}, 0
    share = {key: [] for key in times}
    for r in range(args.runs):
        for load in ("quiet", "loaded"):
            busy = subprocess.Popen([sys.executable, "-c", SPIN.format(args.busy - 1)],
                                    **({"start_new_session": True} if args.apart else {"process_group": 0})) \
                if load == "loaded" else None
            try:
                for name, env in variants.items():
                    if load == "loaded" and name.endswith(":quiet"):
                        continue
                    k += 1
                    seconds, cpus, said[name, load] = timed(cmd(k), {**base, **env})
                    times[name, load].append(seconds)
                    share[name, load].append(cpus)
                    print(f"run {r + 1}/{args.runs} {load:6s} {name}: {seconds:.1f} s", flush=True)
            finally:
                if busy:
                    os.killpg(busy.pid, signal.SIGKILL)
                    busy.wait()
    C = usable_cpus()
    sessions = args.apart and autogroup() == "on"
    times_q = C / max(C - args.busy, C / 2) if sessions else (args.busy + C) / C
    fair = statistics.median(times["as is", "quiet"]) * times_q
    print(f"\n`train.py configs/demo.py --tokens={args.tokens}`; {C} usable CPUs, {args.busy} busy processes "
          f"{'in a session of their own' if args.apart else 'in its session'} (autogroup {autogroup()}): fair "
          f"share {fair:.1f} s ({times_q:.1f} x the quiet median as is); {args.runs} runs each\n")
    print("| variant | threads (start-up line, quiet / loaded) | quiet s, median (min-max) | loaded s, median "
          "(min-max) | loaded / fair, median (worst) | CPUs kept busy, quiet / loaded |\n|---|---|---|---|---|---|")
    for name in variants:
        q, lo = times[name, "quiet"], times[name, "loaded"]
        loaded = (f"{statistics.median(lo):.1f} ({min(lo):.1f}-{max(lo):.1f}) | {statistics.median(lo) / fair:.2f} "
                  f"({max(lo) / fair:.2f})") if lo else "- | -"
        threads = " / ".join(said[name, load] for load in ("quiet", "loaded") if (name, load) in said)
        busy = " / ".join(f"{statistics.median(share[name, load]):.2f}" for load in ("quiet", "loaded")
                          if share[name, load])
        print(f"| {name} | {threads} | {statistics.median(q):.1f} ({min(q):.1f}-{max(q):.1f}) | {loaded} | {busy} |")


if __name__ == "__main__":
    main()
