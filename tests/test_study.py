"""The study runner's plans: each plan file parses, alone and under plans/quick.py, and says what it finds and costs;
plans/h200.py gives the commands the committed H200 run ran (results/h200-2026-11-28/study.log), its power figures
from that run's seed spread are the issue's; a plan's mistakes are named before any step; the H200 plan runs at tiny
sizes on a slice of ../shared/data and reports an interval over its three pretraining seeds."""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import demo
import train
from support import suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")
needs_shared = pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED, "study")),
                                  reason="../shared/data (the study corpora and tasks) is not beside the checkout")
PILOT = os.path.join(ROOT, "results", "h200-2026-11-28", "study")
H200 = os.path.join(ROOT, "plans", "h200.py")


def plan_of(*files, **values):
    return demo.parse_plan([os.path.join(ROOT, f) for f in files] + [f"--{k}={v!r}" for k, v in values.items()])


@pytest.mark.parametrize("files", [[]] + [[p] for p in sorted(glob.glob(os.path.join(ROOT, "plans", "*.py")))
                                          if not p.endswith(("quick.py", "h200_sequel.py"))]
                         + [["plans/h200.py", "plans/h200_sequel.py"]])
def test_every_plan_parses_alone_and_tiny_and_says_what_it_costs(files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)  # plans name their corpora and configs from the repository root
    for stack in (files, [*files, "plans/quick.py"]):
        plan = plan_of(*stack)
        steps = demo.steps_of(plan, stack)
        assert [s.name for s in steps][0] == "corpora" and steps[-1].name == "report"
        for step in steps:  # every step after those it reads
            assert set(step.needs) <= {s.name for s in steps[:steps.index(step)]}
        for step in [s for s in steps if s.kind == "train"]:  # every training command is a config train.py takes
            train.parse_config([a for a in step.cmd[1:] if not a.startswith("--out_dir")])
        demo.main([*stack, "--power", "--spread=0.5"])
        printed = capsys.readouterr().out
        assert "pretraining:" in printed and re.search(r"^\| given \| 0\.50 \|", printed, re.M)


def test_h200_plan_runs_the_commands_of_the_committed_run(tmp_path):
    """Each train.py and data.py command of plans/h200.py is the run's (results/h200-2026-11-28/study.log; its
    probe and warm-up runs were its time rule's, which set the sizes the plan now fixes), paths aside; its CKA and
    fine-tuning settings are the run's."""
    logged = [shlex.split(line[2:]) for line in open(os.path.join(ROOT, "results", "h200-2026-11-28", "study.log"))
              if line.startswith("$ ")]
    plan = plan_of("plans/h200.py", out=str(tmp_path))
    steps = {s.name: s.cmd for s in demo.steps_of(plan, ["plans/h200.py"])}

    def config(cmd):  # train.py's Config of a command, its paths left out
        c = vars(train.parse_config([os.path.join(ROOT, a) if a.startswith("configs/") else a for a in cmd[1:]]))
        return {k: v for k, v in c.items() if k not in ("data_dir", "out_dir", "init_from")}
    ran = {os.path.basename(next(a for a in cmd if a.startswith("--out_dir="))): cmd for cmd in logged
           if cmd[0] == "train.py"}
    for run in ("base", "clm_s17", "clm_s42", "clm_s43", "mlm_s17", "mlm_s42", "mlm_s43"):
        assert config(steps[run]) == config(ran[run]), run
    for name, cmd in (("prepare_general", logged[0]), ("prepare_domain", logged[1])):
        assert [a for a in steps[name] if not a.startswith("/")] == [a for a in cmd if not a.startswith("/")]
    cka = next(cmd for cmd in logged if cmd[0] == "cka.py")
    assert cka[cka.index("--n"):cka.index("--n") + 4] == steps["cka_clm_s17-mlm_s17"][3:7]
    demo.write_suite(plan)  # the fine-tuning as the run wrote it, the data aside
    seeds, tasks = suite.load_suite(str(tmp_path / "suite.py"))
    was = suite.load_suite(os.path.join(PILOT, "suite.py"))
    assert seeds == was[0] and [{**t, "data": None} for t in tasks] == [{**t, "data": None} for t in was[1]]


def test_power_from_the_h200_pilot(capsys):
    """From the committed run's spread (3 pretraining x 3 fine-tuning seeds): the design finds 3.6 points on
    NCBI-disease and 1.5 on their average with 80% power (1.31x the intervals' half-widths 2.73 and 1.16), and +0.5
    points needs 40 and 9 pretraining seeds an arm; on AnatEM the spread of the three D_s (0.17) is below what the
    fine-tuning seeds alone give (sqrt(0.389 / 3) = 0.36), which sets it: 1.18 points, 7 seeds."""
    demo.main([H200, "--power", f"--pilot={PILOT}"])
    rows = dict((name, cells) for name, *cells in re.findall(
        r"^\| clm: (\w+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| (\d+) \| (\d+) \|$", capsys.readouterr().out, re.M))
    assert rows["ncbi_disease"][1:] == ["3.58", "107", "40", "17"]
    assert rows["anatem"] == ["0.36", "1.18", "14", "7", "4"]
    assert rows["average"][1:] == ["1.52", "21", "9", "5"]


@pytest.mark.parametrize("values, says", [
    (dict(seeds={"clm": [17]}), "`seeds` must give exactly the arms their pretraining seeds: mlm is in one and not"),
    (dict(baseline="bert"), "baseline='bert' is not an arm (clm, mlm)"),
    (dict(arms={"clm": "--objective=clm", "mlm": []}), "an arm is a list of train.py overrides"),
    (dict(seeds={"clm": [17, 17], "mlm": [17]}), "each arm's seeds are distinct integers"),
    (dict(seeds={"clm": [43], "mlm": [17, 42]}), "every other arm needs a pretraining seed the baseline has too"),
    (dict(domain=["corpus.jsonl"]), "no tasks: give `suite`"),
    (dict(domain_weights=[1, 2]), "give its held-out texts in `heldout_texts`"),
    (dict(cka_seed=4), "unknown config key 'cka_seed'"),
])
def test_a_plans_mistake_is_one_line_before_any_step(values, says, tmp_path):
    with pytest.raises(SystemExit, match=re.escape(says)):
        plan_of(out=str(tmp_path), **values)
    assert not os.listdir(tmp_path)


def test_cka_pairs_each_arm_at_each_seed_and_the_baselines_ring():
    pairs, controls = demo.cka_pairs(plan_of(seeds={"clm": [17, 42, 43], "mlm": [17, 42, 43]}))
    assert pairs == [("clm_s17", "mlm_s17"), ("clm_s42", "mlm_s42"), ("clm_s43", "mlm_s43")]
    assert controls == [("mlm_s17", "mlm_s42"), ("mlm_s42", "mlm_s43"), ("mlm_s43", "mlm_s17")]
    pairs, controls = demo.cka_pairs(plan_of(arms={"clm": [], "frz": [], "mlm": []},
                                             seeds={"clm": [17, 42], "frz": [42], "mlm": [17, 42]}))
    assert pairs == [("clm_s17", "mlm_s17"), ("clm_s42", "mlm_s42"), ("frz_s42", "mlm_s42")]
    assert controls == [("mlm_s17", "mlm_s42")]  # two seeds: one control, not the same pair twice


def test_a_key_train_py_does_not_know_is_said_before_any_step(tmp_path):
    r = subprocess.run([sys.executable, "demo.py", "plans/quick.py", f"--out={tmp_path / 'study'}",
                        "--arms={'clm': ['--objectiv=clm'], 'mlm': ['--objective=mlm']}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "unknown config key 'objectiv'" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "study").exists()


@needs_shared
def test_h200_plan_tiny_on_a_slice_of_the_study_corpora(tmp_path):
    """plans/h200.py under plans/quick.py: its design (a BPE of the general text, the base, six arms side by side,
    three tasks of ../shared/data cut to their first examples, three pairs and three controls) on the first 300
    documents of each corpus, then a report with an interval over the three pretraining seeds."""
    r = subprocess.run([sys.executable, "demo.py", "plans/h200.py", "plans/quick.py", f"--out={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    for task in ("ncbi_disease", "anatem", "gad", r"\*\*average\*\*"):
        number = r"[-+]\d+\.\d\d"
        assert re.search(rf"^\| clm \| {task} \| {number} \[{number}, {number}\] \| \d+\.\d\d \| \d / \d \| \d / \d \| "
                         rf"{number} \(s17\) / {number} \(s42\) / {number} \(s43\) \|$", report, re.M), task
    assert "| layers | clm vs mlm (3 pairs) | control: mlm's seeds (3 pairs) |" in report
    assert "Tasks every run finished: ncbi_disease, anatem, gad." in report
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results["scores"]["gad"]) == sorted(demo.runs_of(plan_of("plans/h200.py")))
