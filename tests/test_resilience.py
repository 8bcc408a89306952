"""train.py on a cluster: preemption (SIGTERM, kill -9, one process and torchrun), damaged checkpoints, a full disk,
nodes that do not share out_dir. Every interrupted run must log what an uninterrupted one does, bit for bit."""

import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch

from data import load_meta
from model import ModernBertForMaskedLM
from support.card import latest_records
from support.checkpoint import (MANIFEST, TRAIN_STATE, check_init_from, checkpoint_problem, latest_valid_checkpoint,
                                rng_state, save_checkpoint, set_rng_state, weights_only)
from support.metrics import records, trim_metrics
from test_links import tiny  # noqa: F401 (a fixture)
from test_train import ROOT, base_ckpt, data_dir, metrics, train_cmd, train_here  # noqa: F401 (fixtures)
from train import build_model

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def children(pid):
    """torchrun's workers (Linux /proc)."""
    try:
        return [int(child) for task in os.listdir(f"/proc/{pid}/task")
                for child in open(f"/proc/{pid}/task/{task}/children").read().split()]
    except FileNotFoundError:
        return []


@pytest.fixture
def start():
    """Start a training command; what is left of it at the end is killed, torchrun's workers (in sessions of their
    own) included."""
    procs = []

    def launch(cmd):
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                      env=ENV))
        return procs[-1]

    yield launch
    for proc in procs:
        for pid in children(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def finish(proc, check=True, timeout=300):
    """-> (exit code, stdout, stderr); a run that hangs (a rank left waiting) fails the test."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0 or not check, out[-3000:] + err[-3000:]
    return proc.returncode, out, err


def test_a_manifest_that_is_no_manifest_is_damaged_and_skipped(tiny, tmp_path, capsys):
    """A checkpoint truncated, corrupted, unfinished, or whose manifest.json is valid JSON of another shape (never
    weights-only) or lists files outside its directory with their right sizes and sha256: damaged, with the reason,
    and resume takes the one before it."""
    model, optimizer, c = tiny
    for step in (10, 20):
        save_checkpoint(str(tmp_path / f"ckpt-{step}"), model, optimizer, {"step": step}, c)
    ckpt = tmp_path / "ckpt-20"
    assert checkpoint_problem(str(ckpt)) is None and latest_valid_checkpoint(str(tmp_path)) == str(ckpt)
    damaged = tmp_path / "damaged"
    for name, damage, expect in [
            ("train_state.pt", lambda f: os.truncate(f, 100), "train_state.pt has 100 bytes"),
            ("model.safetensors", lambda f: f.write_bytes(b"x" + f.read_bytes()[1:]), "model.safetensors does not "
                                                                                      "match its sha256"),
            ("config.json", os.remove, "config.json is missing"),
            ("manifest.json", os.remove, "no manifest.json")]:
        shutil.copytree(ckpt, damaged)
        damage(damaged / name)
        assert expect in checkpoint_problem(str(damaged))
        shutil.rmtree(damaged)
    assert "sha256" not in (checkpoint_problem(str(ckpt), checksums=False) or "")

    good = json.loads((ckpt / MANIFEST).read_text())
    entry = good["model.safetensors"]
    weights = "its entry 'model.safetensors' is not a file of the directory with its bytes and sha256"
    for manifest, why in [
            ([], "JSON array"),
            (None, "JSON null"),
            ({**good, TRAIN_STATE: None}, f"its entry '{TRAIN_STATE}' is not a file of the directory"),
            ({**good, "model.safetensors": {**entry, "bytes": str(entry["bytes"])}}, weights),
            ({**good, "model.safetensors": {**entry, "bytes": -1}}, weights),
            ({**good, "model.safetensors": {**entry, "sha256": entry["sha256"][:63]}}, weights),
            ({"../ckpt-10/" + name: e for name, e in good.items()}, "its entry '../ckpt-10/")]:
        (ckpt / MANIFEST).write_text(json.dumps(manifest))
        assert not weights_only(str(ckpt))
        capsys.readouterr()
        assert latest_valid_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-10")
        said = capsys.readouterr().err
        assert f"warning: checkpoint {ckpt} is damaged ({MANIFEST} is unreadable ({ckpt / MANIFEST}" in said, said
        assert why in said, said
    os.remove(tmp_path / "ckpt-10" / "manifest.json")  # ckpt-20's is still the last one above
    with pytest.raises(SystemExit, match="no valid checkpoint in .*ckpt-20, .*ckpt-10 are damaged"):
        latest_valid_checkpoint(str(tmp_path))


@pytest.mark.parametrize("failure", ["ENOSPC", "file size limit"])
def test_failed_write_keeps_the_previous_checkpoint_and_says_how_much_space(tiny, tmp_path, monkeypatch, failure):
    model, optimizer, c = tiny
    save_checkpoint(str(tmp_path / "ckpt-10"), model, optimizer, {"step": 10}, c)
    if failure == "ENOSPC":  # a full disk half-way through train_state.pt, as an OSError
        real_save = torch.save

        def full_disk(obj, f):
            real_save(obj, f)
            os.truncate(f, os.path.getsize(f) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f)

        monkeypatch.setattr(torch, "save", full_disk)
    else:  # a real failed write: torch.save raises a RuntimeError then, safetensors its own error
        sizes = json.loads((tmp_path / "ckpt-10" / "manifest.json").read_text())
        limit = (sizes["model.safetensors"]["bytes"] + sizes["train_state.pt"]["bytes"]) // 2
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        with pytest.raises(SystemExit) as e:
            save_checkpoint(str(tmp_path / "ckpt-20"), model, optimizer, {"step": 20}, c)
    finally:
        if failure != "ENOSPC":
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        monkeypatch.undo()
    message = str(e.value)
    assert f"could not write checkpoint {tmp_path / 'ckpt-20'}" in message, message
    assert "GiB free" in message and "previous checkpoints are intact" in message
    assert failure != "ENOSPC" or "No space left on device" in message
    need = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights and two Adam moments, float32
    said = float(re.search(r"needs about (\S+) GiB", message)[1]) * 2 ** 30
    assert abs(said / need - 1) < 0.01, message
    assert sorted(os.listdir(tmp_path)) == ["ckpt-10"]  # no partial ckpt-20, no temporary directory
    assert checkpoint_problem(str(tmp_path / "ckpt-10")) is None
    ModernBertForMaskedLM.from_pretrained(str(tmp_path / "ckpt-10"))
    assert torch.load(tmp_path / "ckpt-10" / "train_state.pt", weights_only=False)["step"] == 10


def test_damaged_init_from_names_the_file(tiny, data_dir, tmp_path):
    model, optimizer, c = tiny
    ours = str(tmp_path / "ours")
    save_checkpoint(ours, model, optimizer, {"step": 16}, c)
    os.truncate(os.path.join(ours, "model.safetensors"), 1000)
    with pytest.raises(SystemExit, match=f"init_from={ours} is damaged: model.safetensors has 1000 bytes"):
        check_init_from(ours, load_meta(data_dir), data_dir, c.seq_len)
    hf = tmp_path / "hf"  # a Hugging Face directory has no manifest: the load itself must name the file
    model.save_pretrained(hf)
    os.truncate(hf / "model.safetensors", 1000)
    c.init_from = str(hf)
    with pytest.raises(SystemExit, match=f"cannot load {hf / 'model.safetensors'} .*is the file complete"):
        build_model(c, load_meta(data_dir), str(hf))


def test_rng_state_reads_and_restores_this_ranks_cuda_stream(monkeypatch):
    """The CUDA branch without a GPU (test_gpu.py resumes on one; on CPU every resume test with dropout shows the CPU
    stream restored): it must read and restore the stream of this rank's device."""
    cpu = torch.device("cpu")
    streams, restored = {1: torch.tensor([7], dtype=torch.uint8)}, []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: streams[device.index])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((s, device)))
    gpu = torch.device("cuda", 1)
    state = rng_state(gpu)
    assert set(state) == {"cpu", "cuda"} and torch.equal(state["cuda"], streams[1])
    set_rng_state(state, gpu)
    assert restored == [(state["cuda"], gpu)]
    set_rng_state(state, cpu)  # a GPU checkpoint resumed on CPU: the CPU stream only
    set_rng_state({"cpu": state["cpu"]}, gpu)  # a CPU checkpoint resumed on GPU: the GPU keeps its seed
    assert len(restored) == 1


def test_nodes_without_a_shared_out_dir_stop_with_a_clear_error(data_dir, base_ckpt, tmp_path, start):
    # Each rank gets its own out_dir, as two nodes with node-local disks would.
    (tmp_path / "node_local.py").write_text(f"import os\nout_dir = {str(tmp_path)!r} + '/node' + os.environ['RANK']\n")
    cmd = train_cmd(tmp_path, data_dir, f"--init_from={base_ckpt}", "--ckpt_interval=4",
                    str(tmp_path / "node_local.py"), nproc=2)
    code, out, err = finish(start(cmd), check=False)
    assert code != 0 and (tmp_path / "node0" / "ckpt-4").is_dir()
    assert f"rank 1 on {socket.gethostname()} (no such directory)" in err and "shared by all nodes" in err, err[-3000:]
    assert "rank 0 on" not in err

    # Re-run: rank 0 would resume from its ckpt-4, which rank 1 cannot see.
    code, out, err = finish(start(cmd), check=False)
    assert code != 0 and "resuming" not in out
    assert f"checkpoint {tmp_path / 'node1' / 'ckpt-4'}" in err and "shared by all nodes" in err, err[-3000:]


# 40 main + 10 decay steps, a log every 4 steps and a checkpoint every 10: a checkpoint between two
# logs (a signal, a timer) must carry the half-summed loss of the next log into the resumed run.
ARGS = [f"--tokens={40 * 8 * 64}", "--log_interval=4", "--ckpt_interval=10", "--eval_interval=20"]


def losses(records):
    return [(m["step"], m["loss"], m.get("val_mlm_loss"), m.get("val_clm_loss")) for m in records]


def logged(out):
    """The last step in out/metrics.jsonl so far (0 before the first record)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return max((json.loads(line)["step"] for line in f if line.endswith("\n")), default=0)
    except FileNotFoundError:
        return 0


def ckpt_steps(out):
    return sorted(int(p.name.split("-")[1]) for p in out.glob("ckpt-*"))


def stopped_at(stdout, cause):
    """The step of the one line train.py logs when a signal stops it."""
    said = [line for line in stdout.splitlines() if line.startswith(f"stopped by {cause} at step ")]
    assert len(said) == 1 and "re-run the same command to resume" in said[0], stdout[-3000:]
    return int(said[0].split(" at step ")[1].split(":")[0])


def worker_pids(proc):
    """{rank: pid} of a torchrun process's workers."""
    pids = {}
    for pid in children(proc.pid):
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        pids[int(env[b"RANK"])] = pid
    return pids


def wait_for(condition, proc, what, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def stop(proc, pid=None):
    """SIGTERM to `pid` (default: the process itself) -> (exit code, stdout, stderr)."""
    os.kill(pid or proc.pid, signal.SIGTERM)
    return finish(proc, check=False, timeout=60)


@pytest.fixture(scope="module")
def reference(data_dir, base_ckpt, tmp_path_factory):
    """The metrics of an uninterrupted run: what every interrupted and resumed run must log."""
    out = tmp_path_factory.mktemp("reference")
    train_here(out, data_dir, f"--init_from={base_ckpt}", *ARGS)
    return losses(metrics(out))


def test_sigterm_then_kill9_and_a_truncated_checkpoint_resume_exactly(data_dir, base_ckpt, reference, tmp_path,
                                                                       start):
    """SIGTERM: a checkpoint at the next step boundary, exit 143, resumed there. Then kill -9 while a checkpoint is
    written at every step (ckpt_every_minutes, which a resume may change), the newest cut short, and the partial
    folder of a save that a kill cut short: resumed from the one before, the partial folder removed. The logged
    numbers are the uninterrupted run's, checkpoints between two logs included."""
    cmd = train_cmd(tmp_path, data_dir, f"--init_from={base_ckpt}", *ARGS)
    proc = start(cmd)
    wait_for(lambda: logged(tmp_path) >= 4, proc, "step 4")
    code, out, err = stop(proc)
    assert code == 143, out[-2000:] + err[-2000:]
    at = stopped_at(out, "SIGTERM")
    assert ckpt_steps(tmp_path)[-1] == at and at % 10, "a checkpoint between interval checkpoints"
    assert logged(tmp_path) <= at and not (tmp_path / "final").exists()

    proc = start(cmd + ["--ckpt_every_minutes=1e-9"])
    wait_for(lambda: (tmp_path / f"ckpt-{at + 6}").exists(), proc, f"ckpt-{at + 6}")
    proc.kill()
    assert f"resuming at step {at}" in proc.communicate()[0]
    newest = ckpt_steps(tmp_path)[-1]
    assert newest - 1 in ckpt_steps(tmp_path) and at + 6 <= newest < 40, ckpt_steps(tmp_path)
    for name in ("model.safetensors", "train_state.pt"):  # a copy cut short
        file = tmp_path / f"ckpt-{newest}" / name
        os.truncate(file, file.stat().st_size // 2)
    partial = tmp_path / ".tmp-ckpt-99"  # a save a kill cut short, of a step this run never writes again
    shutil.copytree(tmp_path / f"ckpt-{newest - 1}", partial)
    os.remove(partial / MANIFEST)
    os.truncate(partial / "train_state.pt", 1000)

    code, out, err = finish(start(cmd))
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and f"ckpt-{newest} is damaged" in warning[0] and "bytes" in warning[0], err[-2000:]
    assert f"resuming at step {newest - 1}" in out and not list(tmp_path.glob(".tmp-*"))  # the partial save removed
    assert losses(metrics(tmp_path)) == reference, "checkpoints between logs must not change the logged numbers"


def test_torchrun_ranks_stop_together_and_resume_exactly(data_dir, base_ckpt, tmp_path, start):
    """The uninterrupted run's first checkpoint write is slow, as on a shared filesystem: with the default
    dist_timeout_minutes rank 1 waits for it in a collective (a short timeout stops the run: the next test)."""
    args = [f"--init_from={base_ckpt}", "--micro_batch_size=2", *ARGS, f"--tokens={24 * 8 * 64}"]  # dropout 0.1
    started = time.time()
    finish(start(slow_save(train_cmd(tmp_path / "whole", data_dir, *args, nproc=2), tmp_path)))
    assert time.time() - started > 6
    out = tmp_path / "stopped"

    # SIGTERM to rank 1 alone: rank 0 learns it through the step's all-reduce and stops at the same step.
    proc = start(train_cmd(out, data_dir, *args, nproc=2))
    wait_for(lambda: logged(out) >= 4, proc, "step 4")
    code, stdout, err_one = stop(proc, worker_pids(proc)[1])
    first = stopped_at(stdout, "a signal to another rank")  # what rank 0 says
    assert ckpt_steps(out)[-1] == first and logged(out) <= first
    ranks = torch.load(out / f"ckpt-{first}" / "train_state.pt", weights_only=False)["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["rng"]["cpu"], ranks[1]["rng"]["cpu"])

    # SIGTERM to torchrun, which forwards it to both workers.
    proc = start(train_cmd(out, data_dir, *args, nproc=2))
    wait_for(lambda: logged(out) >= first + 4, proc, f"step {first + 4}")
    code, stdout, err_all = stop(proc)
    second = stopped_at(stdout, "SIGTERM")
    assert code != 0 and ckpt_steps(out)[-1] == second > first
    assert "forcefully exiting" not in err_one + err_all, "an exit that hangs until torchrun kills it (after 30 s)"

    finish(start(train_cmd(out, data_dir, *args, nproc=2)))
    assert losses(metrics(out)) == losses(metrics(tmp_path / "whole"))


SLOW_SAVE = """import runpy, sys, time
sys.path.insert(0, {root!r})
import support.checkpoint as checkpoint
real, calls = checkpoint.save_checkpoint, []
def slow_save(*args, **kwargs):
    time.sleep(0 if calls else {seconds})
    calls.append(1)
    return real(*args, **kwargs)
checkpoint.save_checkpoint = slow_save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def slow_save(cmd, tmp_path, seconds=6):
    """The train_cmd `cmd`, its first checkpoint write `seconds` s slower, as on a slow shared filesystem."""
    wrapper = tmp_path / "slow_save.py"
    wrapper.write_text(SLOW_SAVE.format(root=ROOT, seconds=seconds))
    at = cmd.index(os.path.join(ROOT, "train.py"))
    return cmd[:at] + [str(wrapper)] + cmd[at:]


def test_a_short_timeout_stops_ranks_that_wait_for_a_slow_checkpoint_write(data_dir, base_ckpt, tmp_path, start):
    """A 2-second timeout (what a short default would do): rank 1 gives up waiting in a collective while rank 0
    writes ckpt-2. (The default timeout waits: test_torchrun_ranks_stop_together_and_resume_exactly.)"""
    cmd = train_cmd(tmp_path, data_dir, f"--init_from={base_ckpt}", "--micro_batch_size=2", f"--tokens={4 * 8 * 64}",
                    "--run_phases=main", "--ckpt_interval=2", "--eval_interval=4", "--dist_timeout_minutes=0.0333",
                    nproc=2)
    code, out, err = finish(start(slow_save(cmd, tmp_path)), check=False)
    assert code != 0 and not (tmp_path / "final").exists()
    assert re.search(r".*(Timed out|timed out|Timeout).*", err), err[-3000:]


def test_metrics_lines_that_hold_no_record_are_kept_and_skipped(tmp_path, capsys):
    """A resume cuts the records past its step and a line a kill cut short; any other line stays where it is, with a
    warning, and the card's reader passes over it. A FIFO in its place (a read would wait for ever): one line."""
    path = tmp_path / "metrics.jsonl"
    lines = ['{"step": 4, "loss": 2.0}', "[4, 2.0]", '{"step": "6"}', "not json", b"\xff\xfe".decode("latin-1"),
             '{"step": 7.0}', '{"step": true}', '{"loss": 1.0}', '{"step": 8, "loss": "n/a"}',
             '{"step": 8, "loss": 1.5}', '{"step": 12, "loss": 1.0}']
    path.write_bytes("\n".join(lines).encode("latin-1") + b'\n{"step": 16, "lo')
    trim_metrics(str(path), 8)
    assert path.read_bytes() == "\n".join(lines[:-1]).encode("latin-1") + b"\n"
    assert capsys.readouterr().err == (f"warning: {path}: line(s) 2, 3, 4, 5, 6, 7, 8 hold no record (a JSON object "
                                       "with an integer step): kept as they are; readers skip them\n")
    assert records(str(path)) == [{"step": 4, "loss": 2.0}, {"step": 8, "loss": "n/a"}, {"step": 8, "loss": 1.5}]
    last, val = latest_records(str(tmp_path), 8)
    assert last == {"step": 8, "loss": 1.5} and val is None
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(SystemExit, match="metrics.jsonl is a FIFO.*metrics.jsonl is the run's log; move it away"):
        trim_metrics(str(path), 8)
