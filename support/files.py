"""
Files from elsewhere. Checkpoints, data directories, tokenizers, locks and results travel between people and sit on
shared filesystems where others can write, so every script reads and writes them by two rules, kept here once:

- reading: a file is read only if it is a regular file of a size such a file can have (a FIFO would block, a
  directory or a device is no file of ours), and JSON only if it parses and has the shape its reader expects;
  anything else is a ValueError that names the file, which the caller turns into its one line;
- writing: nothing is written, renamed or deleted through a symbolic link that the project did not make.
"""

import json
import math
import os
import stat

MAX_JSON = 1 << 28  # bytes: a tokenizer.json of a 250k vocabulary is about 20 MB; no JSON file of ours comes near


# -----------------------------------------------------------------------------
# Reading


def read_bytes(path, limit):
    """The bytes of the regular file `path`, once it is no larger than `limit`; else a ValueError naming it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer, then is refused
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
                "a device or a socket"
            raise ValueError(f"{path} is {kind}, not a file")
        if st.st_size > limit:
            raise ValueError(f"{path} has {st.st_size:,} bytes, more than such a file can hold ({limit:,})")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:  # it grew while read
            raise ValueError(f"{path} has more than {limit:,} bytes, more than such a file can hold")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path, shape=dict, limit=MAX_JSON):
    """The JSON value in `path`, once it is of type `shape` (dict: a JSON object; list: an array); else a ValueError
    naming the file and what it holds instead."""
    data = read_bytes(path, limit)
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"{path} is not JSON this code reads: it is nested too deeply") from None
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, shape) or isinstance(value, bool) and shape is not bool:
        raise ValueError(f"{path} holds a JSON {json_type(value)} where a JSON {json_type(shape())} is expected")
    return value


def json_type(value):
    """JSON's name for the type of a parsed value."""
    for t, name in ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), ((int, float), "number")):
        if isinstance(value, t):
            return name
    return "null"


def whole(value, lo=0, hi=1 << 63):
    """value is a JSON whole number in [lo, hi]: not a boolean, and not 768.0 either (our files write integers)."""
    return type(value) is int and lo <= value <= hi


def number(value, lo=-math.inf, hi=math.inf):
    """value is a finite JSON number in [lo, hi], not a boolean."""
    return (type(value) is int or type(value) is float and math.isfinite(value)) and lo <= value <= hi


# -----------------------------------------------------------------------------
# Writing
