"""support/files.py's reading rule: a file from elsewhere is read only if it is a regular file of a sane size, and
JSON only if it parses to the shape its reader expects; anything else is a ValueError that names the file. Checked
against what the operating system and the json module say of the same files."""

import json
import os
import threading

import pytest

from support.files import number, read_bytes, read_json, whole


def within(seconds, fn):
    """fn() in a thread, so that a read that blocks (a FIFO opened for reading waits for a writer) fails the test
    after `seconds` instead of hanging the run. -> what fn returned or raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still blocked after {seconds} s"
    return out


def test_a_regular_file_is_read_whole(tmp_path):
    data = os.urandom(40 << 20)  # three reads of 16 MB
    (tmp_path / "f").write_bytes(data)
    assert read_bytes(str(tmp_path / "f"), len(data)) == data


@pytest.mark.parametrize("kind, said", [("fifo", "is a FIFO, not a file"), ("dir", "is a directory, not a file"),
                                        ("device", "is a device or a socket, not a file")])
def test_what_is_no_file_is_refused_without_waiting(tmp_path, kind, said):
    path = {"fifo": str(tmp_path / "fifo"), "dir": str(tmp_path), "device": "/dev/null"}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # no writer: an ordinary open() would wait for one forever
    out = within(30, lambda: read_json(path))
    assert isinstance(out.get("error"), ValueError) and str(out["error"]) == f"{path} {said}"


def test_a_file_larger_than_its_kind_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "big.json").write_text(json.dumps({"x": "a" * 1000}))
    size = os.path.getsize(tmp_path / "big.json")
    with pytest.raises(ValueError, match=f"big.json has {size:,} bytes, more than such a file can hold \\(100\\)"):
        read_json(str(tmp_path / "big.json"), limit=100)
    assert read_json(str(tmp_path / "big.json"), limit=size) == {"x": "a" * 1000}


@pytest.mark.parametrize("text, said", [
    ("{\"a\": ", "is not valid JSON (Expecting value"),
    ("\xff\xfe{}", "is not valid JSON"),  # not UTF-8 (written as latin-1 below)
    ("[" * 100_000 + "]" * 100_000, "is not JSON this code reads: it is nested too deeply"),
    ("[1, 2]", "holds a JSON array where a JSON object is expected"),
    ("\"text\"", "holds a JSON string where a JSON object is expected"),
    ("true", "holds a JSON boolean where a JSON object is expected"),
    ("null", "holds a JSON null where a JSON object is expected"),
], ids=["cut short", "not UTF-8", "nested too deeply", "an array", "a string", "a boolean", "null"])
def test_json_of_another_shape_is_named_with_its_file(tmp_path, text, said):
    (tmp_path / "x.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError) as e:
        read_json(str(tmp_path / "x.json"))
    assert str(e.value).startswith(f"{tmp_path / 'x.json'} {said}") and "\n" not in str(e.value)


def test_json_of_the_expected_shape_reads_as_json_loads_does(tmp_path):
    value = {"a": [1, 2.5, None, True], "b": {"c": "é"}}
    (tmp_path / "x.json").write_text(json.dumps(value))
    assert read_json(str(tmp_path / "x.json")) == value
    (tmp_path / "y.json").write_text("[1, 2]")
    assert read_json(str(tmp_path / "y.json"), list) == [1, 2]


def test_whole_numbers_and_numbers_are_json_numbers_not_booleans():
    assert whole(0) and whole(768, 1, 768) and whole(10 ** 30, 0, 10 ** 31)
    assert not any(whole(v) for v in (True, False, 768.0, "768", None, -1, [1]))
    assert not whole(769, 1, 768) and not whole(0, 1)
    assert number(1e-5, 0) and number(3) and number(10 ** 400)  # a JSON integer of any size compares exactly
    assert not any(number(v) for v in (True, float("nan"), float("inf"), -float("inf"), "1", None))
    assert not number(-0.5, 0) and not number(2, 0, 1)
