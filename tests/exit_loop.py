"""Count failed exits of a finished 2-process torchrun run (not collected by pytest: a rare failure needs
100 runs, far more than CI affords).

    python tests/exit_loop.py --runs 100                      # this checkout, beside a CPU load
    python tests/exit_loop.py --runs 100 --code /tmp/before   # another copy of the code (git archive of a commit)

Each run is the tiny 2-process gloo run of tests/test_train.py (16 main + 4 decay steps, an evaluation and a
checkpoint every 8 steps); it must print `done:` and exit 0. A run that exits otherwise is a failure; its
stderr (with every thread's Python stack, PYTHONFAULTHANDLER=1, when a rank aborts) goes to --log.
The CPU load is one busy process (on a 2-core machine: half of it), started here and stopped at the end
(--load 0 for none).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2, local_attention=16)


def make_data(code, tmp):
    """The synthetic corpus of tests/test_train.py, prepared by the code under test."""
    script = f"""
import random, sys
sys.path.insert(0, {code!r})
from data import prepare, read_documents
from support.tokenizer import train_bpe
rng = random.Random(0)
nouns = ["cell", "gene", "protein", "tumor", "patient", "dose", "virus"]
verbs = ["binds", "inhibits", "expresses", "treats"]
docs = [" ".join(f"the {{rng.choice(nouns)}} {{rng.choice(verbs)}} a {{rng.choice(nouns)}}."
                 for _ in range(rng.randint(1, 6))) for _ in range(3000)]
open({tmp!r} + "/corpus.txt", "w").write("\\n".join(docs))
train_bpe(iter(docs), 300, {tmp!r} + "/tokenizer.json")
prepare(lambda: read_documents([{tmp!r} + "/corpus.txt"]), {tmp!r} + "/tokenizer.json", {tmp!r} + "/shards",
        val_docs=200)
"""
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    return os.path.join(tmp, "shards")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--code", default=ROOT, help="the directory holding the train.py to run")
    p.add_argument("--load", type=int, default=1, help="busy processes beside the runs")
    p.add_argument("--log", default="exit_loop.log")
    p.add_argument("--port", type=int, default=29650)
    args = p.parse_args()
    code = os.path.abspath(args.code)
    tmp = tempfile.mkdtemp(prefix="exit_loop-")
    data_dir = make_data(code, tmp)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    failed, seconds = [], []
    try:
        with open(args.log, "a") as log:
            for i in range(args.runs):
                out = os.path.join(tmp, f"run{i}")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                       f"--master_port={args.port + i % 50}", os.path.join(code, "train.py"),
                       f"--data_dir={data_dir}", f"--out_dir={out}", f"--model_config={TINY!r}", "--seq_len=64",
                       "--global_batch_size=8", "--micro_batch_size=2", f"--tokens={16 * 8 * 64}",
                       f"--warmup_tokens={4 * 8 * 64}", "--lr=3e-3", "--decay_frac=0.25", "--log_interval=1",
                       "--eval_interval=8", "--eval_windows=16", "--ckpt_interval=8", "--device=cpu"]
                started = time.time()
                r = subprocess.run(cmd, capture_output=True, text=True, cwd=code, env=env)
                seconds.append(time.time() - started)
                ok = r.returncode == 0 and "done:" in r.stdout
                if not ok:
                    failed.append(i)
                    log.write(f"===== run {i}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-20000:]}\n")
                    log.flush()
                print(f"run {i + 1}/{args.runs}: exit {r.returncode} in {seconds[-1]:.1f} s"
                      f"{'' if ok else '  FAILED'}; failed so far {len(failed)}", flush=True)
                subprocess.run(["rm", "-rf", out])
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print(f"{args.code}: {len(failed)} failed exits in {len(seconds)} runs (runs {failed}); "
          f"median {sorted(seconds)[len(seconds) // 2]:.1f} s a run, load {args.load}")


if __name__ == "__main__":
    main()
