"""
Can the tests fail? Plant one-line slips ("mutants"), one at a time, in a copy of the repository, run the
tests that cover each, and print which ones no test notices. Not part of CI (pytest collects test_*.py only):
run it by hand, before and after changing tests or the code they cover.

    python tests/mutate.py                                  # every mutant: about 20 minutes on 2 busy cores
    python tests/mutate.py --only eval.best_by_reference data.epochs_repeat   # some of them
    python tests/mutate.py --before                         # without the tests issue 31 added (ADDED below)
    python tests/mutate.py --without tests/test_data.py::test_two_epochs_are_two_permutations_of_every_window
                                                            # as if that test did not exist (node-id prefixes)
    python tests/mutate.py --baseline                       # each selection on the unmutated copy: must pass
    python tests/mutate.py --all-at-once --tests tests      # the chosen mutants planted together, one run
    python tests/mutate.py --only train. --tests "tests/test_train.py -k phase"   # another selection
    python tests/mutate.py --list

A mutant is (name, file, the exact old text, the new text, the tests that cover it, what a user would get).
The old text must occur exactly once in the file; where it does not (a refactor moved or reworded the code)
the mutant is "n/a", not a survivor: update its old text. The working tree is never touched: the repository
(with tests/.kernels, without .git) is copied to a temporary directory once, each mutant is written there,
its tests run with `python -m pytest -x -q`, and the file is put back. ../shared is linked beside the copy,
so tests that read it skip or run as they do here.

Results: "caught" (a test failed; the first failing test is named), "survived" (the selection passed: no test
there can tell), "n/a" (old text not found), "error" (pytest could not run the selection: collection error,
no test selected), "timeout". Each selection should pass on the unmodified code (--baseline checks it), or a
"caught" means nothing. Keep selections tight: the tests that run the mutated line and check what it computes.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # exact text, once in the file
    new: str
    tests: str  # pytest arguments: files, node ids, -k expressions
    what: str  # the slip, and what a user would get from it


TRAIN = "tests/test_train.py"
EVAL_TESTS = "tests/test_eval.py"

MUTANTS = [
    # --- train.py, and what it logs
    Mutant("train.prefetch_next_phase", "train.py", "step_batches(step, schedule.at(step),",
           "step_batches(step, schedule.at(step + 1),",
           f"{TRAIN} tests/test_compile.py::test_prefetch_keeps_the_stream_and_raises_at_the_step",
           "the prefetch thread builds a step's batches with the next step's phase: the last CLM step trains on an "
           "MLM batch under the causal mask"),
    Mutant("train.warmup_off_by_one", "train.py", "min(1.0, (t + 1) / self.warmup_steps[i])",
           "min(1.0, t / self.warmup_steps[i])", TRAIN, "the warmup starts at lr 0 and reaches the peak a step late"),
    Mutant("train.warmup_from_run_start", "train.py", "min(1.0, (t + 1) / self.warmup_steps[i])",
           "min(1.0, (step + 1) / self.warmup_steps[i])", TRAIN,
           "a later phase's warmup counts from the run's first step, not the phase's: it is skipped"),
    Mutant("train.decay_linear", "train.py", "(1 - math.sqrt(t / self.steps[i]))", "(1 - t / self.steps[i])", TRAIN,
           "the decay is linear instead of 1-sqrt"),
    Mutant("train.weight_decay_coupled", "train.py", "model.param_groups(c.weight_decay / c.lr)",
           "model.param_groups(c.weight_decay)", TRAIN,
           "torch's coupled decay lr_t * wd instead of the decoupled wd * lr_t / lr (1/lr times too weak)"),
    Mutant("train.decay_masks_like_main", "train.py", "mask_prob=c.decay_mask_prob, decay=True",
           "mask_prob=c.mask_prob, decay=True", f"{TRAIN} tests/test_card.py",
           "the decay masks at the main phase's mask_prob (30%) instead of decay_mask_prob (15%)"),
    Mutant("train.val_mlm_at_30", "train.py", 'Phase("val_mlm", "mlm", 0, mask_prob=0.15)',
           'Phase("val_mlm", "mlm", 0, mask_prob=0.3)', f"{TRAIN} tests/test_card.py",
           "val_mlm_loss is measured at 30% masking, not the 15% that the logs and card call it"),
    Mutant("logger.loss_over_log_interval", "support/logger.py", "loss = loss.item() / state.loss_steps",
           "loss = loss.item() / self.c.log_interval", f"{TRAIN} tests/test_card.py",
           "a record logged off the log interval (with an evaluation) divides its loss sum by log_interval, not by "
           "the steps in it"),
    Mutant("logger.mfu_last_step_only", "support/logger.py", "self.flops = self.steps + 1, self.flops + flops",
           "self.flops = self.steps + 1, flops", f"{TRAIN} tests/test_card.py",
           "MFU counts the FLOPs of a record's last step only, over the time of all its steps"),
    Mutant("checkpoint.resume_replays_data", "support/checkpoint.py", 'loader.load_state_dict(saved["loader"])',
           "loader.load_state_dict(loader.state_dict())", f"{TRAIN} -k resume",
           "a resumed run starts the data stream over"),
    Mutant("freeze.zero_grad_is_exact", "support/freeze.py", "p.grad = torch.zeros_like(p)", "p.grad = None",
           f"{TRAIN} -k 'freeze or frozen'", "freeze_mode zero_grad behaves as exact: not the paper's freeze"),
    # --- data.py
    Mutant("data.epochs_repeat", "data.py", "np.random.default_rng([self.data_seed, epoch])",
           "np.random.default_rng([self.data_seed, 0])", "tests/test_data.py",
           "every epoch visits the windows in the first epoch's order"),
    Mutant("data.mask_90_0_10", "data.py", "torch.where(action < 0.8, special", "torch.where(action < 0.9, special",
           "tests/test_data.py", "BERT masking 90/0/10 instead of 80/10/10"),
    Mutant("data.specials_masked", "data.py", "< mask_prob) & maskable", "< mask_prob)", "tests/test_data.py",
           "[CLS], [SEP], [PAD] can be masked and predicted"),
    Mutant("data.ranks_overlap", "data.py", "start = self.consumed + self.rank * self.micro_batch_size",
           "start = self.consumed + self.rank", "tests/test_data.py",
           "rank r starts r windows in, not r micro batches: ranks train on overlapping windows"),
    Mutant("data.clm_first_not_last", "data.py", "last[cu[1:].long() - 1] = True", "last[cu[:-1].long()] = True",
           "tests/test_data.py", "CLM drops the first position of each sequence instead of the last"),
    # --- model.py, and behind it support/hf.py, support/flops.py
    Mutant("hf.bare_encoder_prefix", "support/hf.py", 'state = {"model." + k: v', 'state = {"model" + k: v',
           "tests/test_model.py tests/test_eval.py -k 'transformers or mlm_checkpoint'",
           "a checkpoint of transformers' bare ModernBertModel (keys without 'model.') no longer loads"),
    Mutant("model.large_heads", "model.py", "num_attention_heads=16), **kw}", "num_attention_heads=8), **kw}",
           "tests/test_model.py tests/test_speed.py", "Large has 8 heads of 128 instead of 16 heads of 64"),
    Mutant("model.init_out_std", "model.py", "c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)",
           "c.initializer_range / math.sqrt(c.num_hidden_layers)", "tests/test_model.py",
           "the output projections start at 0.02/sqrt(L) instead of 0.02/sqrt(2L)"),
    Mutant("model.rope_thetas_swapped", "model.py", 'rope = {"global": rope_cos_sin(packing.positions, c.head_dim, '
           'c.global_rope_theta)', 'rope = {"global": rope_cos_sin(packing.positions, c.head_dim, '
           'c.local_rope_theta)', "tests/test_model.py", "global layers rotate with the local theta"),
    Mutant("model.last_layer_global", "model.py", "return layer % self.global_attn_every_n_layers == 0",
           "return (layer + 1) % self.global_attn_every_n_layers == 0", "tests/test_model.py",
           "global attention on layers 2, 5, 8, ... instead of 0, 3, 6, ..."),
    Mutant("flops.peak_h100_first", "support/flops.py", '("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12)',
           '("H100", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12)',
           "tests/test_speed.py tests/test_flops.py", "an H100 PCIe or NVL reports MFU against the SXM peak"),
    Mutant("flops.head_all_tokens", "support/flops.py", "6 * (H * H + H * V) * n_rows", "6 * (H * H + H * V) * "
           "sum(seqlens)", "tests/test_speed.py tests/test_flops.py",
           "MFU counts the LM head on every token, not only the predicted rows"),
    # --- eval.py
    Mutant("eval.best_by_reference", "eval.py", "best_state = copy.deepcopy(core.state_dict())",
           "best_state = core.state_dict()", EVAL_TESTS,
           "the best epoch's weights kept by reference: test is scored (and the model saved) with the last epoch's"),
    Mutant("eval.decay_ignores_warmup", "eval.py", "max(0.0, (total - s) / max(1, total - warmup))",
           "max(0.0, (total - s) / max(1, total))", EVAL_TESTS,
           "with a warmup, the linear decay starts below the peak (Trainer's schedule: from the peak to 0)"),
    Mutant("eval.weight_decay_over_lr", "eval.py", "core.param_groups(args.weight_decay)",
           "core.param_groups(args.weight_decay / args.lr)", EVAL_TESTS,
           "fine-tuning takes pretraining's decoupled form: weight decay 0.01 / 5e-5 = 200 in torch's AdamW"),
    Mutant("eval.multilabel_threshold", "eval.py", "out = (logits > 0).int().tolist()",
           "out = (logits > 0.5).int().tolist()", EVAL_TESTS,
           "multi-label predicts a label at logit > 0.5 (probability 0.62), not probability 0.5"),
    Mutant("eval.ner_skips_o_words", "eval.py", "firsts = [k for k, t in enumerate(y) if t != -100]",
           "firsts = [k for k, t in enumerate(y) if t > 0]", EVAL_TESTS,
           "NER scoring takes the first sub-tokens of non-O words only, so words get their neighbours' predictions"),
    Mutant("eval.weighted_f1_unweighted", "eval.py", "(f1s * support).sum() /", "f1s.sum() /", EVAL_TESTS,
           "weighted F1 is not weighted by support"),
    Mutant("eval.select_last_tie", "eval.py", "val[args.select] > best", "val[args.select] >= best", EVAL_TESTS,
           "among epochs with the same validation score the last is kept, not the first (Trainer keeps the first)"),
    # --- cka.py, support/suite.py
    Mutant("cka.regions_22", "cka.py", "return [(0, 8), (8, 15), (15, 22)]", "return [(0, 7), (7, 15), (15, 22)]",
           "tests/test_cka.py tests/test_trajectory.py", "the paper's first region is layers 0-6, not 0-7"),
    Mutant("cka.ratio_inverted", "cka.py", "[p / c for p, c in zip(pair, control)]",
           "[c / p for p, c in zip(pair, control)]", "tests/test_cka.py tests/test_trajectory.py",
           "the ratio is control over pair"),
    Mutant("cka.uncentred_y", "cka.py", "X, Y = X - X.mean(0), Y - Y.mean(0)", "X, Y = X - X.mean(0), Y",
           "tests/test_cka.py", "linear CKA without centring Y"),
    Mutant("suite.t_quantile_df", "support/suite.py", "half = t975(len(d) - 1)", "half = t975(len(d))",
           "tests/test_suite.py", "the paired interval uses n degrees of freedom, not n - 1: too narrow"),
]


# The tests issue 31 added, each against an outside expectation: --before leaves them out, for the table as it
# was before them.
ADDED = [
    "tests/test_train.py::test_every_step_trains_on_the_batch_its_phase_calls_for",
    "tests/test_train.py::test_evaluations_measure_mlm_at_15_percent_and_clm",
    "tests/test_train.py::test_each_step_runs_at_its_phase_lr",
    "tests/test_train.py::test_logged_loss_is_the_mean_of_the_steps_since_the_last_record",
    "tests/test_train.py::test_logged_mfu_is_the_flops_of_the_steps_since_the_last_record",
    "tests/test_data.py::test_two_epochs_are_two_permutations_of_every_window",
    "tests/test_model.py::test_presets_are_the_released_configs",
    "tests/test_model.py::test_init_follows_modernbert_at_22_layers",
    "tests/test_model.py::test_bare_encoder_checkpoint_from_transformers_loads_into_classifiers",
    "tests/test_speed.py::test_every_gpu_in_the_peak_table_gets_its_own_peak",
    "tests/test_eval.py::test_test_split_is_scored_with_the_selected_epochs_weights",
    "tests/test_eval.py::test_fine_tuning_optimizer_is_the_trainers",
    "tests/test_eval.py::test_multilabel_predicts_at_probability_one_half",
    "tests/test_eval.py::test_ner_scores_are_seqeval_on_the_saved_models_first_sub_tokens",
    "tests/test_cka.py::test_regions_are_the_papers_at_22_layers_and_thirds_otherwise",
    "tests/test_cka.py::test_ratios_and_regions_are_computed_from_the_per_seed_divergences",
]


def copy_repository(dest):
    """The working tree as it is (tracked, untracked, tests/.kernels), without .git and caches, at dest/<name>;
    ../shared linked beside it."""
    repo = os.path.join(dest, os.path.basename(ROOT))
    shutil.copytree(ROOT, repo, symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "out", "*.pyc"))
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared):
        os.symlink(shared, os.path.join(dest, "shared"))
    return repo


def pytest_args(tests, without, stop_first=True):
    """The pytest command for a selection, less the node ids (prefixes) in `without`."""
    args = [a for a in shlex.split(tests) if not any(a == w or a.startswith(w + "::") for w in without)]
    if not any(a.startswith("tests") for a in args):  # all left out: pytest would run its testpaths, everything
        return None
    deselect = [x for w in without for x in ("--deselect", w)]
    # -o addopts=: pytest.ini's -q with ours would be -qq, which drops the line of counts
    return [sys.executable, "-m", "pytest", *(["-x"] if stop_first else []), "-q", "-o", "addopts=", "-p",
            "no:cacheprovider", *args, *deselect]


def run_tests(repo, cmd, timeout):
    """-> (outcome, first failing test, seconds, pytest's last line) of a pytest run in the copy."""
    if cmd is None:
        return "no tests", "", 0.0, ""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a stale .pyc of a mutant must never be imported
    started = time.time()
    # Its own process group: on a timeout or an interrupt, pytest and the runs it started (train.py, torchrun)
    # all stop, not only pytest.
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", "", time.time() - started, ""
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.time() - started
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", stdout, re.M)
    outcome = {0: "passed", 1: "failed", 5: "no tests"}.get(proc.returncode, "error")
    counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped|deselected).*?)\s*=*$", stdout, re.M)
    summary = counts[-1] if counts else (stdout.strip().splitlines() or [stderr.strip()[-200:]])[-1]
    return outcome, failed[0] if failed else ("" if outcome != "error" else summary), seconds, summary


def plant(repo, m):
    """Write the mutant into the copy; -> the original text to put back, or None when its old text is not
    there exactly once."""
    path = os.path.join(repo, m.file)
    with open(path) as f:
        text = f.read()
    if text.count(m.old) != 1:
        return None
    with open(path, "w") as f:
        f.write(text.replace(m.old, m.new))
    return text


def restore(repo, m, text):
    with open(os.path.join(repo, m.file), "w") as f:
        f.write(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=[], help="mutant names (or name prefixes, e.g. eval.)")
    p.add_argument("--without", nargs="+", default=[], metavar="NODEID",
                   help="tests to leave out, as pytest node ids or their prefixes (a file, a file::test)")
    p.add_argument("--before", action="store_true", help="leave out the tests issue 31 added (ADDED)")
    p.add_argument("--baseline", action="store_true", help="run each distinct selection on the unmutated copy")
    p.add_argument("--all-at-once", action="store_true", help="plant the chosen mutants together and run --tests")
    p.add_argument("--tests", help="pytest arguments that replace each mutant's selection (with --all-at-once: the "
                                   "one run's; default there: tests)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    # SIGTERM as Ctrl-C: the running tests are stopped and the temporary copy removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.before:
        args.without += ADDED

    chosen = [m for m in MUTANTS if not args.only or any(m.name == o or m.name.startswith(o) for o in args.only)]
    if not chosen:
        raise SystemExit(f"--only {' '.join(args.only)}: no such mutant (see --list)")
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.file:22} {m.what}\n{'':32} tests: {m.tests}")
        return

    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        repo = copy_repository(tmp)
        left_out = "the tests issue 31 added" if args.before else ""
        left_out = ", ".join(filter(None, [left_out, *[w for w in args.without if w not in ADDED or not args.before]]))
        print(f"copy of {ROOT} in {repo}; left out: {left_out or 'nothing'}", flush=True)
        if args.baseline:
            print("| selection | unmutated | first failing test | s |\n|---|---|---|---|")
            for tests in dict.fromkeys(args.tests or m.tests for m in chosen):
                outcome, first, seconds, _ = run_tests(repo, pytest_args(tests, args.without), args.timeout)
                print(f"| `{tests}` | {outcome} | {first} | {seconds:.0f} |", flush=True)
            return
        if args.all_at_once:
            originals = {}
            for m in chosen:
                if m.file not in originals:
                    with open(os.path.join(repo, m.file)) as f:
                        originals[m.file] = f.read()
                if plant(repo, m) is None:
                    print(f"{m.name}: old text not found once in {m.file} (n/a)")
            tests = args.tests or "tests"
            cmd = pytest_args(tests, args.without, stop_first=False)
            outcome, first, seconds, summary = run_tests(repo, cmd, args.timeout * len(chosen))
            print(f"{len(chosen)} mutants planted together, `{tests}`: {outcome} ({summary}) in {seconds:.0f}s"
                  + (f"; first failing test {first}" if first else ""))
            return

        rows, started = [], time.time()
        print("| mutant | file | result | first failing test | s |\n|---|---|---|---|---|", flush=True)
        for m in chosen:
            original = plant(repo, m)
            if original is None:
                result, first, seconds = "n/a", "old text not found once", 0.0
            else:
                try:
                    cmd = pytest_args(args.tests or m.tests, args.without)
                    outcome, first, seconds, _ = run_tests(repo, cmd, args.timeout)
                finally:
                    restore(repo, m, original)
                result = {"failed": "caught", "passed": "survived"}.get(outcome, outcome)
            rows.append((m, result))
            print(f"| {m.name} | {m.file} | {result} | {first} | {seconds:.0f} |", flush=True)
        counts = {r: sum(1 for _, x in rows if x == r) for r in dict.fromkeys(x for _, x in rows)}
        print(f"\n{len(rows)} mutants in {(time.time() - started) / 60:.1f} min: "
              + ", ".join(f"{n} {r}" for r, n in counts.items()))
        survivors = [m for m, r in rows if r == "survived"]
        for m in survivors:
            print(f"  survived: {m.name} ({m.file}): {m.what}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the tests were stopped, the copy removed
        sys.exit("interrupted")
