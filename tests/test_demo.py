"""The README's commands are the ones CI and this test run: the set-up commands, the demo pipeline end to end
(small), and every command the README gives after it, run on what the demo left."""

import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def readme_commands(section="Set up"):
    """The command lines of the code blocks of one of README.md's sections."""
    text = README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```\n(.+?)\n```", text, re.S) for line in block.split("\n")]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A checkout as a user has it (links to this one's files), where `python demo.py --quick` ran: its outputs are
    in out/demo, where the README's commands look for them. -> (the folder, the demo's output)."""
    work = tmp_path_factory.mktemp("checkout")
    for name in os.listdir(ROOT):
        if name not in ("out", ".git"):
            os.symlink(os.path.join(ROOT, name), work / name)
    r = subprocess.run([sys.executable, "demo.py", "--quick"], cwd=work, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work, r.stdout


def test_readme_commands_are_what_ci_runs():
    main, tests = readme_commands()
    assert main.endswith("python demo.py") and main.startswith("pip install -r requirements.txt")
    assert tests == "pip install -r requirements-dev.txt && bash tests/install_kernels.sh && python -m pytest"
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert ci[-1] == tests, "the last line of .ci/run must be the README's test command"


def test_demo_pipeline_quick(checkout):
    work, stdout = checkout
    out = work / "out" / "demo"
    assert stdout.count("\n$ ") == stdout.count("  done in "), "every step says when it ends"
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
    # The task's splits and the domain's texts (pretraining, held-out) share no text: nothing the test scores is seen
    files = ("task/train.jsonl", "task/validation.jsonl", "task/test.jsonl", "text/domain.jsonl", "text/heldout.jsonl")
    texts = {name: [json.loads(line)["text"] for line in (out / name).read_text().splitlines()] for name in files}
    assert all(texts.values()) and sum(map(len, texts.values())) == len(set().union(*texts.values()))


def test_readme_table_has_the_digits_the_demo_prints_and_its_time(checkout):
    """The README's table shows what report.md prints, to its digits: losses to 3 decimals (the fourth moves
    between CPUs' kernels), F1 and CKA to 2; the README and demo.py give the same time."""
    work, _ = checkout
    report = (work / "out" / "demo" / "report.md").read_text()
    printed = re.findall(r"^\| (?:clm|mlm|mlm_twin) \| --objective=\S+(?: --seed=42)? \| (\S+) \| (\S+) \|$", report,
                         re.M)
    shown = re.findall(r"^\| (?:CLM detour|MLM|MLM seed twin \(control\)) \| (\S+) \| (\S+) \|([^|]*)\|([^|]*)\|$",
                       README, re.M)
    assert len(printed) == len(shown) == 3
    decimals = lambda numbers: {len(x.split(".")[1]) for x in re.findall(r"\d+\.\d+", " ".join(numbers))}  # noqa: E731
    assert decimals(x for row in printed for x in row) == decimals(x for row in shown for x in row[:2]) == {3}
    f1 = re.findall(r"^\| (?:clm|mlm) \| (\d+\.\d+ ± \d+\.\d+) \|", report, re.M)
    assert len(f1) == 2 and decimals(f1) == decimals(row[2] for row in shown) == {2}
    assert decimals(row[3] for row in shown) == {2}  # CKA (%), as report.md's region table
    minutes = re.search(r"The run takes (\d+-\d+) minutes on 2 free CPU cores", README)
    assert minutes and f"# {minutes[1]} minutes on 2 free CPU cores" in open(os.path.join(ROOT, "demo.py")).read()


def test_readme_commands_after_the_demo_run_on_its_outputs(checkout):
    """The commands of the README's demo section, as written, in the checkout where the demo ran."""
    work, _ = checkout
    commands = readme_commands("The demo")
    assert len(commands) >= 4 and any(c.startswith("torchrun") for c in commands)
    for command in commands:
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]  # python and torchrun: this one's
        r = subprocess.run(command, shell=True, cwd=work, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": path})
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


def test_every_other_readme_command_names_files_that_exist_and_arguments_its_script_takes(monkeypatch, tmp_path):
    """The GPU, cluster and real-data commands cannot run here: each one's script and config files exist, and its
    arguments pass the script's own parser (train.py's configs parse, under the world size torchrun would give)."""
    import train
    monkeypatch.chdir(tmp_path)  # the --out folders the parsers check are written here, not in the checkout
    sections = re.findall(r"^## (.+)$", README, re.M)
    lines = [c for s in sections if s not in ("Set up", "The demo") for c in readme_commands(s)]
    commands = [shlex.split(c.split("#")[0]) for c in lines if c.split()[0] in ("python", "torchrun", "sbatch")]
    assert len(commands) >= 15
    for words in commands:
        if words[0] == "sbatch":
            words = ["torchrun", "--nproc_per_node=4"] + words[words.index("slurm/train.sbatch") + 1:]
            assert subprocess.run(["bash", "-n", os.path.join(ROOT, "slurm", "train.sbatch")]).returncode == 0
        if words[:3] == ["python", "-m", "pytest"]:
            assert all(os.path.isfile(os.path.join(ROOT, w)) for w in words[3:] if w.endswith(".py")), words
            continue
        script = next(w for w in words if w.endswith(".py"))
        args = words[words.index(script) + 1:]
        assert os.path.isfile(os.path.join(ROOT, script)), script
        options = dict(re.findall(r"--(nproc_per_node|nnodes)=(\d+)", " ".join(words[:words.index(script)])))
        world = int(options.get("nproc_per_node", 1)) * int(options.get("nnodes", 1))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        if script == "train.py":
            train.parse_config([a if not a.startswith("configs/") else os.path.join(ROOT, a) for a in args])
        else:
            importlib.import_module(script[:-3].replace("/", ".")).parse_args([a for a in args if a != "--"])
