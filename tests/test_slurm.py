"""slurm/train.sbatch on a real one-node SLURM on localhost (CPU only, no systemd or cgroups), submitted as a user
would, a tiny run on 2 processes preempted twice as SLURM does it: the warning signal to the batch shell (`scancel -b
-s TERM`, what --signal=B:TERM@300 sends), then `scontrol requeue` (SIGTERM to the shell and the step at once). Each
time the job comes back by itself under the same id and resumes; the run ends with an uninterrupted one's metrics, bit
for bit. Runs where Debian's slurm-wlm and munge are installed (.ci/run installs them); skips elsewhere."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from test_recipes import run_record
from test_resilience import logged
from test_train import ROOT, base_ckpt, data_dir, free_port, train_cmd  # noqa: F401 (fixtures)

TOOLS = ("slurmctld", "slurmd", "sbatch", "munged", "munge")
missing = [d for d in TOOLS if not shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
pytestmark = pytest.mark.skipif(bool(missing) or os.geteuid() != 0,
                                reason=f"needs a local SLURM (as root): {', '.join(missing)} not installed (Debian: "
                                       "apt-get install slurm-wlm munge)" if missing else "needs root to start SLURM")
SBIN = "/usr/sbin"
# 200 main + 50 decay steps of 8 x 64 tokens on 2 processes (micro batch 2: 2 micro batches per rank), dropout on.
# A preemption lands about a second after the test sends it (its 0.5 s poll, then SLURM's signal): up to 50 steps on
# this machine when idle, more on a faster one. 250 steps leave both stops well before the end.
MAIN_STEPS, END = 200, 250
ARGS = ["--micro_batch_size=2", f"--tokens={MAIN_STEPS * 8 * 64}", "--log_interval=2", "--ckpt_interval=50",
        "--eval_interval=100"]


SLURM_CONF = """\
ClusterName=test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits for its credential to expire before it starts again (120 s by default)
AuthInfo=cred_expire=5
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobRequeue=1
ReturnToService=2
# SIGTERM to SIGKILL at a requeue: the step's end is waited for that long
KillWait=10
MpiDefault=none
StateSaveLocation={tmp}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def munge_works():
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def slurm_says(env, *command):
    return subprocess.run(command, capture_output=True, text=True, env=env).stdout.strip()


def wait_until(condition, failure, timeout=120, every=0.2):
    """Poll until `condition` holds; past `timeout` s (generous: a busy machine is slow), fail saying failure()."""
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, failure()
        time.sleep(every)


@pytest.fixture
def slurm(tmp_path):
    """A one-node SLURM on localhost: munged (if none runs yet), slurmctld, slurmd. -> the clients' environment.
    The daemons it started are stopped by their pid files at the end."""
    tmp = tmp_path / "slurm"
    (tmp / "state").mkdir(parents=True)
    # slurmstepd's sockets live in the spool: under pytest's tmp_path their path can pass a socket's 108 bytes
    spool = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
    conf = tmp / "slurm.conf"
    conf.write_text(SLURM_CONF.format(tmp=tmp, spool=spool, ctld_port=free_port(), slurmd_port=free_port(),
                                      cpus=os.cpu_count()))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": os.path.dirname(sys.executable) + ":" + os.environ["PATH"]}
    started = []
    if not munge_works():
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", f"{SBIN}/munged"], check=True)
        started.append("/run/munge/munged.pid")
        wait_until(munge_works, lambda: "munged does not answer")
    subprocess.run([f"{SBIN}/slurmctld", "-f", str(conf)], check=True, env=env)
    started.append(str(tmp / "slurmctld.pid"))
    subprocess.run([f"{SBIN}/slurmd", "-f", str(conf), "-N", "localhost"], check=True, env=env)
    started.append(str(tmp / "slurmd.pid"))
    try:
        node = lambda: slurm_says(env, "sinfo", "-h", "-o", "%T")  # noqa: E731
        wait_until(lambda: "idle" in node(), lambda: f"the node is not idle: {node()}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--user=root"], env=env)  # a test that failed midway
        deadline = time.time() + 30
        while slurm_says(env, "squeue", "-h") and time.time() < deadline:
            time.sleep(0.2)
        for pid_file in reversed(started):
            try:
                os.kill(int(open(pid_file).read()), signal.SIGTERM)
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
        shutil.rmtree(spool, ignore_errors=True)


def job_state(job, env):
    """(JobState, Restarts) of a job, from scontrol."""
    fields = dict(f.split("=", 1) for f in slurm_says(env, "scontrol", "show", "job", "-o", job).split() if "=" in f)
    return fields.get("JobState", "?"), int(fields.get("Restarts", 0))


def test_slurm_job_is_preempted_requeued_and_resumes_exactly(slurm, data_dir, base_ckpt, tmp_path):  # noqa: F811
    env = slurm
    out, log, whole = tmp_path / "slurm_run", tmp_path / "job.out", tmp_path / "whole"
    args = train_cmd(out, data_dir, f"--init_from={base_ckpt}", *ARGS)[2:]  # train.py's --key=value
    # the uninterrupted run, beside the job: SLURM's waits (a requeue, a credential's expiry) leave the CPUs idle
    with open(tmp_path / "whole.log", "w") as whole_log:
        reference = subprocess.Popen(train_cmd(whole, data_dir, f"--init_from={base_ckpt}", *ARGS, nproc=2), cwd=ROOT,
                                     stdout=whole_log, stderr=subprocess.STDOUT, env={**env, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    job = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", "--time=10",
                          f"--output={log}", os.path.join(ROOT, "slurm", "train.sbatch"), *args],
                         capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**env, "NPROC_PER_NODE": "2"}).stdout.strip()
    timeline = [("submit", 0.0)]

    def text():
        return log.read_text() if log.exists() else ""

    def alive():  # -> None: not there yet
        state = job_state(job, env)[0]
        assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL"), f"{state}: {text()}"

    def wait(what, condition):
        wait_until(lambda: condition() or alive(), lambda: f"timed out waiting for {what}: {job_state(job, env)}\n"
                   f"{text()}", timeout=180, every=0.5)
        timeline.append((what, time.time() - t0))

    wait("running", lambda: job_state(job, env)[0] == "RUNNING")
    for restart, (name, preempt) in enumerate([("warning signal", ["scancel", "-b", "-s", "TERM", job]),
                                              ("scontrol requeue", ["scontrol", "requeue", job])], start=1):
        steps_before = logged(out)
        wait(f"training (step {steps_before + 4})", lambda: logged(out) >= steps_before + 4)
        subprocess.run(preempt, check=True, env=env)
        timeline.append((name, time.time() - t0))
        wait("checkpoint", lambda: text().count("stopped by SIGTERM") >= restart)
        wait("requeued", lambda: job_state(job, env)[1] == restart)
        wait("running again", lambda: job_state(job, env) == ("RUNNING", restart))
        wait("resumed", lambda: text().count("resuming at step") >= restart)
    wait("end (COMPLETED)", lambda: job_state(job, env)[0] == "COMPLETED")

    print("\nSLURM timeline (s): " + ", ".join(f"{what} {t:.1f}" for what, t in timeline))
    log_text = text()
    stops = [line for line in log_text.splitlines() if "stopped by SIGTERM at step" in line]
    assert len(stops) == 2 and log_text.count("requeue") >= 1, log_text
    for line in stops:  # each stop is followed by a resume from its own checkpoint
        step = line.split(" at step ")[1].split(":")[0]
        assert f"resuming at step {step}" in log_text and int(step) < END, log_text
    assert (out / "final" / "manifest.json").exists()
    assert reference.wait(timeout=300) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    assert run_record(out) == run_record(whole)


def test_a_training_job_its_user_cancels_stays_cancelled(slurm, data_dir, base_ckpt, tmp_path):  # noqa: F811
    """scancel JOB sends SIGTERM as the time-limit warning does: train.py checkpoints, and the job is not requeued."""
    out, log = tmp_path / "run", tmp_path / "job.out"
    args = train_cmd(out, data_dir, f"--init_from={base_ckpt}", "--tokens=10000000", "--ckpt_interval=1000000")[2:]
    job = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
                          f"--output={log}", os.path.join(ROOT, "slurm", "train.sbatch"), *args], capture_output=True,
                         text=True, cwd=ROOT, check=True, env={**slurm, "NPROC_PER_NODE": "1"}).stdout.strip()
    wait_until(lambda: logged(out) >= 2, lambda: f"no training: {job_state(job, slurm)}", timeout=180)
    subprocess.run(["scancel", job], check=True, env=slurm)
    wait_until(lambda: not slurm_says(slurm, "squeue", "-h"), lambda: f"still queued: {job_state(job, slurm)}",
               timeout=120)
    text = log.read_text()
    assert job_state(job, slurm) == ("CANCELLED", 0) and "requeue" not in text, text[-3000:]
    assert "stopped by SIGTERM at step" in text and any(p.name.startswith("ckpt-") for p in out.iterdir()), text[-3000:]


def test_a_study_as_jobs_cancelled_midway_and_resubmitted_reports_what_it_reports_here(slurm, tmp_path):
    """demo.py --slurm: the quick demo plan as jobs, each after the jobs of the steps it reads; while they are queued
    a second submission is refused; one fine-tuning cancelled while it runs takes the report out of the queue; once
    the queue is empty the same command submits what is left, and the report equals the one the same plan makes
    here."""
    env = {**slurm, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "1"}
    here, jobs = tmp_path / "here", tmp_path / "jobs"
    quick = [sys.executable, "demo.py", "plans/quick.py"]
    with open(tmp_path / "here.log", "w") as log:  # the same plan here, beside the jobs
        reference = subprocess.Popen([*quick, f"--out={here}"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     env=env)
    sbatch = "--sbatch={'all': ['--gpus-per-node=0', '--cpus-per-task=1', '--time=10']}"  # no GPU here
    submit = lambda: subprocess.run([*quick, f"--out={jobs}", "--slurm", sbatch], cwd=ROOT, capture_output=True,  # noqa
                                    text=True, env=env)
    first, twice = submit(), submit()
    assert first.returncode == 0, first.stdout + first.stderr
    assert twice.returncode == 1 and "still queued or running" in twice.stderr, twice.stdout + twice.stderr
    record = json.loads((jobs / "slurm_jobs.json").read_text())
    ids = {j["name"]: j["id"] for j in record}
    assert f"--dependency=afterok:{ids['corpora']}:{ids['clm_s17']}" in \
        next(j["command"] for j in record if j["name"] == "eval_clm_s17")
    assert "slurm/train.sbatch" in next(j["command"] for j in record if j["name"] == "clm_s17")
    queue = lambda: slurm_says(env, "squeue", "-h", "-o", "%i %j %T")  # noqa: E731
    # Cancelled once eval.py runs: SLURM says RUNNING before the script starts, and a SIGTERM sent before then is lost
    log = jobs / "logs" / "eval_mlm_s42.slurm.log"
    wait_until(lambda: log.exists() and "to run" in log.read_text(), lambda: f"no fine-tuning ran:\n{queue()}",
               timeout=600)
    subprocess.run(["scancel", ids["eval_mlm_s42"]], check=True, env=env)
    wait_until(lambda: not queue(), lambda: f"the queue did not empty:\n{queue()}", timeout=600)
    assert job_state(ids["eval_mlm_s42"], env)[0] == "CANCELLED" and not (jobs / "report.md").exists()
    again = submit()
    assert again.returncode == 0, again.stdout + again.stderr
    assert [j["name"] for j in json.loads((jobs / "slurm_jobs.json").read_text())] == [*ids, "eval_mlm_s42", "report"]
    wait_until(lambda: (jobs / "report.md").exists() and not queue(), lambda: f"no report:\n{queue()}", timeout=600)
    assert reference.wait(timeout=600) == 0, (tmp_path / "here.log").read_text()[-3000:]
    assert (jobs / "report.md").read_text() == (here / "report.md").read_text()
