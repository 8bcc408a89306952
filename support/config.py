"""
Configs as plain Python: a dataclass of defaults, overridden by config files (`key = value` lines,
run as Python, each seeing the values set before it) and then by --key=value arguments. A key that
the dataclass does not have is an error that lists the valid ones; a value of the wrong type is an
error that names the key.
"""

import ast
import dataclasses
import os
import uuid

from support.files import open_fd, refuse_link


def parse(cls, argv):
    """An instance of the dataclass `cls` from config files and --key=value arguments, in order."""
    valid = {f.name: f for f in dataclasses.fields(cls)}
    values = {}

    def set_key(key, value, where):
        if key not in valid:
            raise SystemExit(f"{where}: unknown config key {key!r}. Valid keys: {', '.join(valid)}")
        values[key] = check_type(key, value, valid[key].type, where)

    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq:
                raise SystemExit(f"{arg}: write overrides as --key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare string
            set_key(key, value, arg)
        else:
            if not os.path.isfile(arg):
                raise SystemExit(f"config file {arg!r} not found: give a path like configs/fr_base.py, or --key=value")
            # The file sees the values so far, so an override file can write out_dir = out_dir + "_mlm".
            for key, value in load_file(arg, dataclasses.asdict(cls(**values))).items():
                set_key(key, value, arg)
    return cls(**values)


def load_file(path, scope=None):
    """The names a Python file (a config, a suite) run in `scope` sets: no imports, functions or _private names."""
    scope = dict(scope or {})
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return {k: v for k, v in scope.items() if not k.startswith("_") and not callable(v)
            and type(v).__name__ != "module"}


def check_type(key, value, typ, where):
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 10e9 tokens
    if typ is tuple and isinstance(value, list):
        return tuple(value)
    if typ is str and not isinstance(value, str):
        value = str(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise SystemExit(f"{where}: {key} must be {typ.__name__}, got {value!r}")
    return value


def check_out_dir(path, name="--out"):
    """The output location is a directory, or can be made one, that this user may write (a probe file is written
    and removed), and holds no link: checked before any work, so no result is lost at the end to a wrong path."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise SystemExit(f"{name}={path}: is a file, not a directory; give a directory path")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):  # where the directory will be made
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise SystemExit(f"{name}={path}: {parent} is a file, not a directory; choose another path")
    probe = os.path.join(parent, f".write-test-{uuid.uuid4().hex}")
    try:
        os.close(open_fd(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"{name}={path} is not writable ({e.strerror}): choose a directory this user can write"
                         f"{', on a filesystem every node shares' if name == 'out_dir' else ''}") from None
    if os.path.isdir(path):  # a link in it is said now, not at the write that would meet it, hours in
        for entry in os.scandir(path):
            refuse_link(entry.path)
