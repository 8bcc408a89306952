"""The README's commands are the ones CI and this test run: the set-up commands, the demo's plan through the study
runner (tiny: plans/quick.py), every command the README gives after it run on what it left, and every other
command's arguments; a study killed midway (the runner by SIGKILL, its training step by the signal that follows)
continues with the same command to the same report."""

import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
QUICK = [sys.executable, "demo.py", "plans/quick.py"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every run: the same numbers


def readme_commands(section="Set up"):
    """The command lines of the code blocks of one of README.md's sections."""
    text = README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```\n(.+?)\n```", text, re.S) for line in block.split("\n")]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A checkout as a user has it (links to this one's files), where the quick demo ran into out/demo, where the
    README's commands look for it. -> (the folder, the runner's output)."""
    work = tmp_path_factory.mktemp("checkout")
    for name in os.listdir(ROOT):
        if name not in ("out", ".git"):
            os.symlink(os.path.join(ROOT, name), work / name)
    os.symlink(os.path.join(ROOT, ".git"), work / ".git")  # the commit the study records
    r = subprocess.run([*QUICK, "--out=out/demo"], cwd=work, capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return work, r.stdout


def test_readme_commands_are_what_ci_runs():
    main, tests = readme_commands()
    assert main.endswith("python demo.py") and main.startswith("pip install -r requirements.txt")
    assert tests == "pip install -r requirements-dev.txt && bash tests/install_kernels.sh && python -m pytest"
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert ci[-1] == tests, "the last line of .ci/run must be the README's test command"


def test_demo_plan_runs_every_step_in_order_and_reports(checkout):
    work, stdout = checkout
    out = work / "out" / "demo"
    ran = re.findall(r"^  (\S+) done in \d+s", stdout, re.M)
    assert stdout.count("\n$ ") + stdout.startswith("$ ") == len(ran), "every step echoed says when it ends"
    assert ran == ["corpora", "prepare_general", "base", "prepare_domain", "clm_s17", "mlm_s17", "mlm_s42",
                   "cka_clm_s17-mlm_s17", "cka_mlm_s17-mlm_s42", "trajectory", "eval_clm_s17", "eval_mlm_s17",
                   "eval_mlm_s42", "report"]
    report = (out / "report.md").read_text()
    for heading in ("## Fine-tuning: each arm minus the baseline", "## CKA: divergence", "## CKA over training",
                    "## Validation losses"):
        assert heading in report
    # One pretraining seed an arm: a difference, and the report says it has no interval over pretraining seeds
    assert re.search(r"^\| clm \| \*\*average\*\* \| [-+]\d+\.\d\d \(one pretraining seed: no interval over "
                     r"pretraining seeds\) \| n/a \| [01] / [01] \| \d / \d \|", report, re.M)
    numbers = [float(x) for line in report.splitlines() if line.startswith("| ")
               for x in re.findall(r"-?\d+\.\d+", line)]
    assert numbers and all(math.isfinite(x) for x in numbers)
    trajectory = [int(line.split("|")[1]) for line in report.splitlines() if re.match(r"\| \d+ \| [\d.]+k \|", line)]
    assert trajectory == [4, 8, 12, 16, 20, 22]  # kept every 4 steps, the end of phase 1 (20), the final (22)
    for png in ("loss.png", "trajectory.png", "cka/clm_s17-mlm_s17/divergence.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({png})" in report
    study = json.loads((out / "study.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert study["sessions"][0]["commit"] == commit and study["plan"]["seeds"] == {"clm": [17], "mlm": [17, 42]}
    assert f"commit {commit[:12]}" in report
    # The task's splits and the domain's texts (pretraining, held-out) share no text: nothing the test scores is seen
    files = ("task/train.jsonl", "task/validation.jsonl", "task/test.jsonl", "text/domain.jsonl", "text/heldout.jsonl")
    texts = {name: [json.loads(line)["text"] for line in (out / name).read_text().splitlines()] for name in files}
    assert all(texts.values()) and sum(map(len, texts.values())) == len(set().union(*texts.values()))


def running(fragment):
    """Whether a process whose command line holds `fragment` is alive (a step the killed runner left)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if fragment.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
        except OSError:
            pass
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="a step learns of its runner's death by PR_SET_PDEATHSIG (Linux)")
def test_a_killed_study_continues_to_the_same_report(checkout):
    work, _ = checkout
    out = work / "out" / "killed"
    runner = subprocess.Popen([*QUICK, "--out=out/killed"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=ENV)
    log, deadline = out / "logs" / "base.log", time.time() + 300
    while not (log.exists() and re.search(r"step \d+/", log.read_text())):  # the base is training
        assert runner.poll() is None and time.time() < deadline, runner.stdout.read()
        time.sleep(0.05)
    runner.kill()  # SIGKILL: the runner cannot pass anything on; train.py gets SIGTERM from the kernel
    runner.wait()
    while running(f"--out_dir={out}/base"):  # it finishes its step and writes a checkpoint
        assert time.time() < deadline
        time.sleep(0.1)
    again = subprocess.run([*QUICK, "--out=out/killed"], cwd=work, capture_output=True, text=True, env=ENV)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.startswith("done earlier: corpora, prepare_general\n")
    assert re.search(r"resuming at step \d+", log.read_text())  # from the checkpoint the SIGTERM wrote
    assert (out / "report.md").read_text() == (work / "out" / "demo" / "report.md").read_text()
    # Another plan into the same folder is refused before any step, its difference named
    other = subprocess.run([*QUICK, "--out=out/killed", "--cka_n=17"], cwd=work, capture_output=True, text=True)
    assert other.returncode == 1 and "cka_n=16 (now 17)" in other.stderr


def test_readme_table_has_the_digits_the_report_prints_and_its_time(checkout):
    """The README's demo table shows what report.md prints, to its digits: losses to 3 decimals (the fourth moves
    between CPUs' kernels), F1 and CKA to 2; the README and demo.py give the same time."""
    work, _ = checkout
    report = (work / "out" / "demo" / "report.md").read_text()
    losses = re.findall(r"^\| (?:clm_s17|mlm_s17|mlm_s42) \| [\d,]+ \| [\d.]+ / [\d.]+ \| (\S+) / (\S+) \|$", report,
                        re.M)
    f1 = re.findall(r"^\| (?:clm_s17|mlm_s17|mlm_s42) \| (\d+\.\d+ ± \d+\.\d+) \|$", report, re.M)
    cka = re.findall(r"^\| \d+-\d+ \| (\d+\.\d+) ± \d+\.\d+ \([\d.]+x\) \| (\d+\.\d+) ± \d+\.\d+ \|$", report, re.M)
    shown = re.findall(r"^\| (?:CLM detour|MLM|MLM seed twin) \(\w+\) \| (\S+) \| (\S+) \|([^|]*)\|([^|]*)\|$", README,
                       re.M)
    assert len(losses) == len(f1) == len(shown) == 3 and len(cka) == 3
    decimals = lambda numbers: {len(x.split(".")[1]) for x in re.findall(r"\d+\.\d+", " ".join(numbers))}  # noqa: E731
    assert decimals(x for row in losses for x in row) == decimals(x for row in shown for x in row[:2]) == {3}
    assert decimals(f1) == decimals(row[2] for row in shown if row[2].strip()) == {2}
    assert decimals(x for row in cka for x in row) == decimals(row[3] for row in shown if row[3].strip()) == {2}
    minutes = re.search(r"The run takes (\d+-\d+) minutes on 2 free CPU cores", README)
    said = f"# the demo: {minutes[1]} minutes on 2 free CPU cores" if minutes else "no time in the README"
    assert said in open(os.path.join(ROOT, "demo.py")).read()


def test_readme_commands_after_the_demo_run_on_its_outputs(checkout):
    """The commands of the README's demo section, as written, in the checkout where the demo ran."""
    work, _ = checkout
    commands = readme_commands("The demo")
    assert len(commands) >= 4 and any(c.startswith("torchrun") for c in commands)
    for command in commands:
        path = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]  # python and torchrun: this one's
        r = subprocess.run(command, shell=True, cwd=work, capture_output=True, text=True, timeout=600,
                           env={**ENV, "PATH": path})
        assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


def test_every_other_readme_command_names_files_that_exist_and_arguments_its_script_takes(monkeypatch, tmp_path,
                                                                                          capsys):
    """The GPU, cluster, study and real-data commands cannot run here: each one's script and config files exist,
    and its arguments pass the script's own parser (train.py's configs parse, under the world size torchrun would
    give; a study's plan files parse and say what they cost)."""
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
        args = [a if not a.startswith(("configs/", "plans/", "results/")) else os.path.join(ROOT, a)
                for a in words[words.index(script) + 1:]]
        assert os.path.isfile(os.path.join(ROOT, script)), script
        options = dict(re.findall(r"--(nproc_per_node|nnodes)=(\d+)", " ".join(words[:words.index(script)])))
        world = int(options.get("nproc_per_node", 1)) * int(options.get("nnodes", 1))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        if script == "train.py":
            train.parse_config(args)
        elif script == "demo.py":  # from the repository root, where a plan's paths start
            with monkeypatch.context() as m:
                m.chdir(ROOT)
                importlib.import_module("demo").main(args if "--power" in args else [*args, "--power", "--spread=1"])
            assert "GPU-hours" in capsys.readouterr().out
        else:
            importlib.import_module(script[:-3].replace("/", ".")).parse_args([a for a in args if a != "--"])
