"""
Can the tests fail? Plant one-line slips ("mutants"), one at a time, in a copy of the repository, run the
tests that cover each, and print which ones no test notices. Not part of CI (pytest collects test_*.py only):
run it by hand, before and after changing tests or the code they cover.

    python tests/mutate.py                                  # every mutant (101): about 15 minutes on 2 cores
    python tests/mutate.py --only eval.best_by_reference data.epochs_repeat   # some of them
    python tests/mutate.py --without tests/test_data.py::test_two_epochs_are_two_permutations_of_every_window
                                                            # as if that test did not exist (node-id prefixes)
    python tests/mutate.py --baseline                       # each selection on the unmutated copy: must pass
    python tests/mutate.py --only train. --tests "tests/test_train.py -k phase"   # another selection
    python tests/mutate.py --list

A mutant (tests/mutants.txt) is: a name, a file, the exact old text, the new text, the tests that cover it, and
what a user would get.
The old text must occur exactly once in the file; where it does not (a refactor moved or reworded the code)
the mutant is "n/a", not a survivor: update its old text. The working tree is never touched: the repository
(with tests/.kernels, without .git) is copied to a temporary directory once, each mutant is written there,
its tests run with `python -m pytest -x -q`, and the file is put back. ../shared is linked beside the copy,
so tests that read it skip or run as they do here.

Results: "caught" (a test failed; the first failing test is named), "survived" (the selection passed: no test
there can tell), "n/a" (old text not found), "error" (pytest could not run the selection: collection error,
no test selected), "timeout". Each selection should pass on the unmodified code (--baseline checks it), or a
"caught" means nothing. Keep selections tight: the tests that run the mutated line and check what it computes.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # exact text, once in the file
    new: str
    tests: str  # pytest arguments: files, node ids, -k expressions
    what: str  # the slip, and what a user would get from it


MUTANTS_FILE = os.path.join(ROOT, "tests", "mutants.txt")


def load_mutants(path=MUTANTS_FILE):
    """The mutants of tests/mutants.txt: blocks of `key: value` lines (the keys of Mutant), a blank line between
    blocks; a value runs to the end of its line, spaces included."""
    mutants, block = [], {}
    with open(path) as f:
        for line in [*f.read().split("\n"), ""]:
            if line.startswith("#"):
                continue
            if line:
                key, value = line.split(": ", 1)
                block[key] = value
            elif block:
                mutants.append(Mutant(**block))
                block = {}
    return mutants


MUTANTS = load_mutants()


def copy_repository(dest):
    """The working tree as it is (tracked, untracked, tests/.kernels), without .git and caches, at dest/<name>;
    ../shared linked beside it."""
    repo = os.path.join(dest, os.path.basename(ROOT))
    shutil.copytree(ROOT, repo, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "out", "*.pyc"))
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(dest, "shared"))
    return repo


def pytest_args(tests, without):
    """The pytest command for a selection, less the node ids (prefixes) in `without`."""
    args = [a for a in shlex.split(tests) if not any(a == w or a.startswith(w + "::") for w in without)]
    if not any(a.startswith("tests") for a in args):  # all left out: pytest would run its testpaths, everything
        return None
    deselect = [x for w in without for x in ("--deselect", w)]
    # -o addopts=: pytest.ini's -q with ours would be -qq, which drops the line of counts
    return [sys.executable, "-m", "pytest", "-x", "-q", "-o", "addopts=", "-p",
            "no:cacheprovider", *args, *deselect]


def run_tests(repo, cmd, timeout):
    """-> (outcome, first failing test, seconds) of a pytest run in the copy."""
    if cmd is None:
        return "no tests", "", 0.0
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a stale .pyc of a mutant must never be imported
    started = time.time()
    # Its own process group: on a timeout or an interrupt, pytest and the runs it started (train.py, torchrun)
    # all stop, not only pytest.
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", "", time.time() - started
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.time() - started
    outcome = {0: "passed", 1: "failed", 5: "no tests"}.get(proc.returncode, "error")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, re.M)
    if outcome == "error" and not failed:  # what pytest said last, in place of a failing test
        failed = (stdout.strip().splitlines() or [stderr.strip()[-200:]])[-1:]
    return outcome, failed[0] if failed else "", seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=[], help="mutant names (or name prefixes, e.g. eval.)")
    p.add_argument("--without", nargs="+", default=[], metavar="NODEID",
                   help="tests to leave out, as pytest node ids or their prefixes (a file, a file::test)")
    p.add_argument("--baseline", action="store_true", help="run each distinct selection on the unmutated copy")
    p.add_argument("--tests", help="pytest arguments that replace each mutant's selection")
    p.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    # SIGTERM as Ctrl-C: the running tests are stopped and the temporary copy removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    chosen = [m for m in MUTANTS if not args.only or any(m.name == o or m.name.startswith(o) for o in args.only)]
    if not chosen:
        raise SystemExit(f"--only {' '.join(args.only)}: no such mutant (see --list)")
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.file:22} {m.what}\n{'':32} tests: {m.tests}")
        return

    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        repo = copy_repository(tmp)
        print(f"copy of {ROOT} in {repo}; left out: {', '.join(args.without) or 'nothing'}", flush=True)
        if args.baseline:
            print("| selection | unmutated | first failing test | s |\n|---|---|---|---|")
            for tests in dict.fromkeys(args.tests or m.tests for m in chosen):
                outcome, first, seconds = run_tests(repo, pytest_args(tests, args.without), args.timeout)
                print(f"| `{tests}` | {outcome} | {first} | {seconds:.0f} |", flush=True)
            return
        rows, started = [], time.time()
        print("| mutant | file | result | first failing test | s |\n|---|---|---|---|---|", flush=True)
        for m in chosen:
            path = os.path.join(repo, m.file)
            with open(path) as f:
                original = f.read()
            if original.count(m.old) != 1:  # a refactor moved or reworded the code: update the old text
                result, first, seconds = "n/a", "old text not found once", 0.0
            else:
                try:
                    with open(path, "w") as f:
                        f.write(original.replace(m.old, m.new))
                    outcome, first, seconds = run_tests(repo, pytest_args(args.tests or m.tests, args.without),
                                                        args.timeout)
                finally:
                    with open(path, "w") as f:
                        f.write(original)
                result = {"failed": "caught", "passed": "survived"}.get(outcome, outcome)
            rows.append((m, result))
            print(f"| {m.name} | {m.file} | {result} | {first} | {seconds:.0f} |", flush=True)
        counts = {r: sum(1 for _, x in rows if x == r) for r in dict.fromkeys(x for _, x in rows)}
        print(f"\n{len(rows)} mutants in {(time.time() - started) / 60:.1f} min: "
              + ", ".join(f"{n} {r}" for r, n in counts.items()))
        survivors = [m for m, r in rows if r == "survived"]
        for m in survivors:
            print(f"  survived: {m.name} ({m.file}): {m.what}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the tests were stopped, the copy removed
        sys.exit("interrupted")
