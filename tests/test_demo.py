"""The README's commands are the ones CI and this test run; the demo pipeline end to end, small."""

import math
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_commands():
    """The two set-up commands: the code lines of README.md's "Set up" section."""
    text = open(os.path.join(ROOT, "README.md")).read()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.+?)\n```", setup)


def test_readme_commands_are_what_ci_runs():
    main, tests = readme_commands()
    assert main.endswith("python demo.py") and main.startswith("pip install -r requirements.txt")
    assert tests == "pip install -r requirements-dev.txt && bash tests/install_kernels.sh && python -m pytest"
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert ci[-1] == tests, "the last line of .ci/run must be the README's test command"


def test_demo_pipeline_quick(tmp_path):
    main, _ = readme_commands()
    demo = shlex.split(main.split("&&")[-1])  # python demo.py
    assert demo == ["python", "demo.py"]
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, *demo[1:], "--quick", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("\n$ ") == r.stdout.count("  done in "), "every step says when it ends"
    report = (out / "report.md").read_text()
    for heading in ("## Settings", "## Final validation loss per arm", "## The decay", "## CKA: divergence",
                    "## CKA over training", "## Fine-tuning on the task"):
        assert heading in report
    tables = [line for line in report.splitlines() if line.startswith("| ")]
    arms = {line.split("|")[1].strip() for line in tables}
    assert {"clm", "mlm", "mlm_twin"} <= arms
    numbers = [float(x) for line in tables for x in re.findall(r"-?\d+\.\d+", line)]
    assert numbers and all(math.isfinite(x) for x in numbers)
    self_line = next(line for line in report.splitlines() if line.startswith("Sanity: CKA of the detour model"))
    assert float(re.search(r"max \|1 - CKA\| = ([-0-9.e+]+)", self_line)[1]) < 1e-9
    trajectory = [line.split("|")[1].strip() for line in tables if line.split("|")[3].strip() in ("main", "decay")]
    assert trajectory == ["4", "8", "10", "11"]  # kept every 4 steps, the phase end, the final
    for png in ("loss.png", "divergence.png", "trajectory.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in report
