"""
metrics.jsonl, a run's log in out_dir: one JSON object per line, each with the integer `step` it was logged at, in
the order logged (support/logger.py appends them). It is the run's history: a resume cuts it back to the step of the
checkpoint it loaded and no further. A line that is no such record (a hand edit, another tool's line, a damaged
disk) is skipped by its readers and kept by a cut, with a warning; a last line without its newline is a write that a
kill cut short, and goes.
"""

import json
import os
import sys

from support.files import open_file, read_bytes, refuse_link, replace_file

METRICS = "metrics.jsonl"
LIMIT = 1 << 30  # bytes: a million logged steps take about 300 MB
TIMINGS = ("tokens_per_s", "mfu", "eval_s", "checkpoint_s", "compile_s")  # of a record's fields, the machine's speed


def record(line):
    """The record on `line` (bytes), or None if it holds none."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) and type(value.get("step")) is int else None


def lines(path):
    """Each complete line of the file `path` (none if there is no file), as bytes, with its record or None."""
    if not os.path.lexists(path):
        return []
    try:
        data = read_bytes(path, LIMIT)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{e}: {path} is the run's log; move it away to start a new one") from None
    return [(line + b"\n", record(line)) for line in data.split(b"\n")[:-1]]


def records(path):
    return [r for _, r in lines(path) if r]


def append(path, rec):
    with open_file(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def trim_metrics(path, step):
    """Keep the records of metrics.jsonl up to `step`, the resume point: a killed run may have logged past its last
    checkpoint, or died in the middle of a line. Lines that hold no record stay where they are."""
    if not os.path.lexists(path):
        return
    refuse_link(path)  # before its lines are read: they are not the run's
    kept = [(n, line, r) for n, (line, r) in enumerate(lines(path), 1) if r is None or r["step"] <= step]
    other = [n for n, _, r in kept if r is None]
    if other:
        print(f"warning: {path}: line(s) {', '.join(map(str, other[:10]))}{' ...' if len(other) > 10 else ''} hold "
              "no record (a JSON object with an integer step): kept as they are; readers skip them", file=sys.stderr)
    replace_file(path, b"".join(line for _, line, _ in kept))
