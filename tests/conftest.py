"""The tests run side by side, one file per worker (pytest-xdist, -n in pytest.ini): most of them use one CPU thread
(OMP_NUM_THREADS=1 in their subprocesses). A test marked `alone` measures the machine's load, so no other test runs
beside it: every test holds the CPUs' lock shared, an `alone` one exclusive, and each takes it through the gate,
which an `alone` test holds while it waits, so that no new test starts meanwhile."""

import fcntl
import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):  # setup, call and teardown: a module's fixtures included
    if not hasattr(item.config, "workerinput"):  # not an xdist worker: nothing runs beside this test
        return (yield)
    alone = item.get_closest_marker("alone") is not None
    run = os.path.dirname(item.config.option.basetemp)  # the run's temporary folder: each worker has one in it
    with open(os.path.join(run, "gate.lock"), "a") as gate, open(os.path.join(run, "cpus.lock"), "a") as cpus:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(cpus, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)  # both locks end with their files
