"""
The paper's downstream table in one command (eval.py --suite): tasks x models x seeds, with seed statistics that
tell a real gain from noise. The suite file is plain Python: `seeds = [...]` and `tasks = [dict(name=..., task=
"cls" | "multilabel" | "ner", data=DIR relative to the file, ...), ...]`, PROTOCOL filling what a task leaves out.
Each finished run is OUT/runs/TASK/MODEL/seedN.json, stored with the options that determine it, so a killed
suite goes on where it stopped; one stored with other options stops the suite before any training (reusing it
would mix two protocols in one table). The table (results.md/.json): per task and model, test macro F1 (the
paper's metric) and the metric other papers report, mean ± std over seeds; their average over tasks; each model's
difference to the first, paired over seeds, with a 95% t interval. For a study (demo.py), the difference of two arms
over both seed levels, pretraining and fine-tuning (nested_delta), and what a design finds with 80% power.
"""

import json
import math
import os

import numpy as np
from scipy import optimize, stats

from support.config import check_type, load_file
from support.files import make_dirs, number, read_json, replace_file

# The fine-tuning protocol: what a task dict (or eval.py's command line) does not say, each with its source: the
# paper, the protocol it follows (BioClinical-ModernBERT: the Hugging Face Trainer's defaults), or our choice.
PROTOCOL = dict(
    lr=5e-5,  # the paper
    batch_size=16,  # the paper: examples per optimizer step, however many micro batches they take
    weight_decay=0.01,  # the paper
    warmup_ratio=0.0,  # the followed protocol: HF Trainer default (no warmup, then its default "linear" decay to 0)
    max_len=None,  # the followed protocol truncates only at the model's maximum: None = its max_position_embeddings
    # (8192 for ModernBERT), another family's own maximum (512 for the BERTs); a task may set less
    max_tokens=None,  # our choice, memory only (the update is the same): tokens per micro batch, None = MAX_TOKENS
    pooling="mean",  # the released ModernBERT checkpoints' classifier_pooling; the paper does not say. Another family
    # keeps the head transformers gives it (BERT: its pooler on [CLS]; RoBERTa: a dense layer on <s>)
    select="macro_f1",  # the paper keeps the best epoch "by validation F1"; we read it as its reported metric
)
MAX_TOKENS = {"cuda": 16384, "cpu": 4096}  # our choice, per device type (results/cpu-2026-11-28: memory)
EPOCHS = {"cls": 10, "multilabel": 10, "ner": 20}  # the paper
SEEDS = [42, 43, 44, 45, 46]  # the paper: 5 seeds for English; which five is our choice (the French 42-50 begin so)
TASK_KEYS = {"name": str, "task": str, "data": str, "epochs": int, "lr": float, "batch_size": int, "max_len": int,
             "max_tokens": int, "warmup_ratio": float, "weight_decay": float, "pooling": str, "select": str}
SELECT = {"cls": ("macro_f1", "micro_f1", "weighted_f1", "accuracy"),  # what `select` may name, per task type
          "multilabel": ("macro_f1", "micro_f1", "subset_accuracy"), "ner": ("macro_f1", "micro_f1")}

METRIC = "macro_f1"  # the paper's
UPSTREAM = {"cls": "weighted_f1", "multilabel": "micro_f1", "ner": "micro_f1"}  # what other papers print beside it
UPSTREAM_NAME = {"cls": "weighted F1", "multilabel": "micro F1", "ner": "entity micro F1"}


def parse_seeds(text):
    """"42,43,44" -> [42, 43, 44]; None if it is not a comma-separated list of integers."""
    parts = [s.strip() for s in str(text).split(",")]
    return [int(s) for s in parts] if all(s.isdigit() for s in parts) else None


def max_tokens(device):
    """The default token budget of a micro batch on this torch.device."""
    return MAX_TOKENS["cuda" if device.type == "cuda" else "cpu"]


def load_suite(path):
    """-> (seeds, tasks): the suite file's seeds, and its tasks with every key filled in."""
    if not os.path.isfile(path):
        raise SystemExit(f"--suite {path}: no such file")
    scope = load_file(path)
    seeds, tasks = scope.get("seeds"), scope.get("tasks")
    if not (isinstance(seeds, (list, tuple)) and seeds and all(type(s) is int for s in seeds)
            and len(set(seeds)) == len(seeds)):
        raise SystemExit(f"{path}: `seeds` must be a list of distinct integers, e.g. seeds = [42, 43, 44, 45, 46]")
    if not (isinstance(tasks, (list, tuple)) and tasks and all(isinstance(t, dict) for t in tasks)):
        raise SystemExit(f"{path}: `tasks` must be a list of dicts, e.g. "
                         "tasks = [dict(name='ncbi_disease', task='ner', data='data/ncbi_disease')]")
    folder = os.path.dirname(os.path.abspath(path))
    out = []
    for n, t in enumerate(tasks, 1):
        where = f"{path}: task {t.get('name', n)!r}"
        unknown = sorted(set(t) - set(TASK_KEYS))
        missing = [k for k in ("name", "task", "data") if k not in t]
        if unknown or missing:
            problem = f"unknown key(s) {unknown}" if unknown else f"no {' and no '.join(missing)}"
            raise SystemExit(f"{where}: {problem}; a task has the keys {', '.join(TASK_KEYS)}")
        if t["task"] not in EPOCHS:
            raise SystemExit(f"{where}: task={t['task']!r}; it must be one of {', '.join(EPOCHS)}")
        task = {**PROTOCOL, "epochs": EPOCHS[t["task"]], **t}
        for key, typ in TASK_KEYS.items():
            if task[key] is None and key in ("max_len", "max_tokens"):  # the model's or the device's, known later
                continue
            task[key] = check_type(key, task[key], typ, where)
            least = 3 if key == "max_len" else 1  # max_len holds [CLS] and [SEP] too
            if typ is int and task[key] < least:
                raise SystemExit(f"{where}: {key} must be an int of at least {least}, got {task[key]!r}")
        if task["select"] not in SELECT[task["task"]]:
            raise SystemExit(f"{where}: select={task['select']!r}; for a {task['task']} task it is one of "
                             f"{', '.join(SELECT[task['task']])}")
        if task["pooling"] not in ("mean", "cls"):
            raise SystemExit(f"{where}: pooling must be 'mean' or 'cls', got {task['pooling']!r}")
        if not task["name"] or task["name"].startswith(".") or "/" in task["name"] or os.sep in task["name"]:
            raise SystemExit(f"{where}: the name names a folder of runs; use letters, digits, '_' or '-'")
        if any(o["name"] == task["name"] for o in out):
            raise SystemExit(f"{where}: two tasks have this name")
        task["data"] = os.path.normpath(os.path.join(folder, os.path.expanduser(task["data"])))
        out.append(task)
    return list(seeds), out


def model_names(paths):
    """Short unique names: the last two components of each path, more where two would clash."""
    parts = [os.path.abspath(p).split(os.sep) for p in paths]
    if len({tuple(p) for p in parts}) < len(parts):
        raise SystemExit(f"--models: a model is given twice ({' '.join(paths)})")
    for k in range(2, max(map(len, parts)) + 1):
        names = ["/".join(p[-k:]).lstrip("/") for p in parts]
        if len(set(names)) == len(names):
            return names


def run_file(out, task, model_name, seed):
    return os.path.join(out, "runs", task, model_name, f"seed{seed}.json")


def finished_runs(runs):
    """runs: [(file, options)] -> ({index: result} of those stored, problems: those stored with other options)."""
    done, problems = {}, []
    for i, (path, options) in enumerate(runs):
        if not os.path.isfile(path):
            continue
        try:  # never raise here: under torchrun the other ranks are waiting for this answer
            stored = read_json(path)
            old, result = dict(stored["options"]), stored["result"]
            metrics = {k: v for k, v in result["test"].items() if k in (METRIC, *UPSTREAM.values())}  # the table's
            if not all(number(v, 0, 1) for v in metrics.values()):
                raise ValueError(f"its test metrics {metrics} must be numbers in [0, 1]")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a file of another shape
            problems.append(f"{path}: not a stored run ({type(e).__name__}: {e})")
            continue
        asked = json.loads(json.dumps(options))  # as it would read back from disk (tuples become lists)
        if old == asked:
            done[i] = result
        else:
            changed = sorted(k for k in old.keys() | asked.keys() if old.get(k) != asked.get(k))
            problems.append(f"{path}: run with " + ", ".join(f"{k}={old.get(k)!r}" for k in changed)
                            + "; now " + ", ".join(f"{k}={asked.get(k)!r}" for k in changed))
    return done, problems


def store_run(path, options, result, out=None):
    """Write a finished run atomically (a kill leaves no half-written run), its folders below `out` none a link."""
    make_dirs(out or os.path.dirname(path), os.path.dirname(path))
    replace_file(path, json.dumps({"options": options, "result": result}, indent=1))


def pct(stats):
    """A mean_std as the tables print it: "mean ± std" in %."""
    return f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f}"


def mean_std(values):
    """Mean and sample std (ddof=1; 0 from one value) of the values, kept beside them."""
    values = [float(v) for v in values]
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            "per_seed": values}


def t_interval(d):
    """The mean of the differences d and its 95% interval mean ± t_{0.975, n-1} sd(d) / sqrt(n); none from one."""
    d = np.asarray(d, dtype=np.float64)
    mean = float(d.mean())
    if len(d) < 2:
        return {"mean": mean, "low": None, "high": None, "n": len(d)}
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": len(d)}


def paired_delta(a, b):
    """b - a where a[i] and b[i] come from the same seed, with its 95% t interval. Pairing takes out what a seed does
    to both models alike (the order of the batches, the classifier's init), which would otherwise count as noise."""
    return t_interval(np.subtract(b, a, dtype=np.float64))


def power(sd, n, delta):
    """The chance that the two-sided 95% t test over n differences of spread sd finds a true difference delta (its
    interval excludes 0): the noncentral t with n - 1 df and noncentrality delta sqrt(n) / sd beyond the critical t."""
    df, ncp = n - 1, delta * math.sqrt(n) / sd
    crit = stats.t.ppf(0.975, df)
    return float(stats.nct.sf(crit, df, ncp) + np.nan_to_num(stats.nct.cdf(-crit, df, ncp)))  # NaN: far below 1e-20


def detectable(sd, n, level=0.8):
    """The true difference that n differences of spread sd find with probability `level`: with 80%, 1.31x the
    interval's half-width at 3 differences (a true difference of the half-width's size is found 61% of the time)."""
    if n < 2 or not sd > 0:
        return None
    return float(optimize.brentq(lambda delta: power(sd, n, delta) - level, 1e-12 * sd, 100 * sd))


def nested_delta(base, arm):
    """arm - base from scores [pretraining seed][fine-tuning seed], paired at both levels. The fine-tuning seeds are
    nested in each pretraining seed: their mean difference D_s is one draw of the design, and the interval is over
    the D_s (t, P - 1 df), so it holds both seeds' noise; with one pretraining seed it gives none. Beside it the
    signs of the D_s and of the paired runs, and the design's spread: Var(D_s) = between + within / F (within: the
    fine-tuning seeds' variance; between: the pretraining seeds' beyond it), estimated from the D_s and the runs by
    the moments, between no less than 0, so never below what the fine-tuning seeds alone give; at that spread, the
    difference the design finds with 80% power."""
    d = np.subtract(arm, base, dtype=np.float64)  # (P, F)
    per_seed, (n_pre, n_ft) = d.mean(axis=1), d.shape
    observed = float(per_seed.var(ddof=1)) if n_pre > 1 else None
    within = float(d.var(axis=1, ddof=1).mean()) if n_ft > 1 else None
    between = None if observed is None else observed if within is None else max(0.0, observed - within / n_ft)
    spread = None if between is None else math.sqrt(between + (within or 0.0) / n_ft)
    return {**t_interval(per_seed), "per_pretraining_seed": per_seed.tolist(), "spread": spread,
            "detectable": detectable(spread, n_pre), "finetune_seeds": n_ft, "within": within, "between": between,
            "signs": {"seeds": [int((per_seed > 0).sum()), int((per_seed < 0).sum())],
                      "runs": [int((d > 0).sum()), int((d < 0).sum())]}}


def design_sd(delta, finetune_seeds):
    """The spread of the D_s with `finetune_seeds` fine-tuning seeds a pretraining seed, from a nested_delta's
    variance components; None where they cannot say (one pretraining seed; one fine-tuning seed and another count)."""
    if delta["between"] is None or (delta["within"] is None and finetune_seeds != delta["finetune_seeds"]):
        return None
    return math.sqrt(delta["between"] + (delta["within"] or 0.0) / finetune_seeds)


def seeds_needed(delta, sd, level=0.8, most=200):
    """The fewest pretraining seeds (None past `most`) whose D_s, of spread sd > 0, find delta with `level` power."""
    return next((n for n in range(2, most + 1) if power(sd, n, delta) >= level), None)


def summarize(suite, seeds, tasks, models, scores):
    """models: {name: path}, the first the reference; scores[(task, model name)]: the test metrics of each seed.
    -> everything results.json holds."""
    names = list(models)

    def compared(metrics, runs):  # runs: {model: the metrics of each seed} -> the table's cells of each model
        cells = {m: {k: mean_std([r[k] for r in runs[m]]) for k in metrics} for m in names}
        base = [r[METRIC] for r in runs[names[0]]]
        for m in names[1:]:
            cells[m]["delta_" + METRIC] = paired_delta(base, [r[METRIC] for r in runs[m]])
        return cells

    results = {"suite": suite, "seeds": seeds, "models": models, "metric": METRIC, "tasks": {
        t["name"]: {**t, "upstream": UPSTREAM[t["task"]], "models": compared(
            (METRIC, UPSTREAM[t["task"]]), {m: scores[t["name"], m] for m in names})} for t in tasks}}
    # The average over tasks: per seed first, so that its delta is paired over seeds like a task's.
    per_seed = {m: np.mean([[r[METRIC] for r in scores[t["name"], m]] for t in tasks], axis=0) for m in names}
    results["average"] = compared((METRIC,), {m: [{METRIC: v} for v in per_seed[m]] for m in names})
    return results


def markdown(results):
    names, seeds, info = list(results["models"]), results["seeds"], results["model_info"]

    def delta(d):
        if d["low"] is None:
            return f"{100 * d['mean']:+.2f} (one seed: no interval)"
        beyond_noise = " *" if d["low"] > 0 or d["high"] < 0 else ""
        return f"{100 * d['mean']:+.2f} [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]{beyond_noise}"

    def row(label, stats, upstream=None):  # a task's line, or the average's (which has no upstream metric)
        cells = [c for m in names for c in (pct(stats[m][METRIC]), pct(stats[m][upstream]) if upstream else "")]
        return "| " + " | ".join([label, *cells, *(delta(stats[m]["delta_" + METRIC]) for m in names[1:])]) + " |"

    lines = [f"# Fine-tuning suite: {results['suite']}", "",
             f"Test scores in %, mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))}). Macro F1 is "
             "the paper's metric; beside it, the metric other papers report (weighted F1 for classification, "
             "micro F1 for multi-label, seqeval entity micro F1 for NER). Δ: macro F1 minus the first "
             f"model's ({names[0]}), paired over seeds, with its 95% t interval; * where the interval excludes 0.",
             "", "Models: " + "; ".join(f"{m} = {p} ({info[m]['family']}, up to {info[m]['max_len']} tokens; "
                                        f"{info[m]['code']})" for m, p in results["models"].items()), "",
             "| task | " + " | ".join(f"{m} macro F1 | {m} upstream" for m in names)
             + "".join(f" | Δ {m}" for m in names[1:]) + " |",
             "|---" * (1 + 2 * len(names) + len(names) - 1) + "|"]
    lines += [row(f"{name} ({t['task']}; upstream: {UPSTREAM_NAME[t['task']]})", t["models"], t["upstream"])
              for name, t in results["tasks"].items()]
    lines += [row(f"**average** ({len(results['tasks'])} tasks)", results["average"]), ""]
    return "\n".join(lines)


def write_results(out, results):
    """results.json and results.md under out (made by eval.py's hold on it); returns the markdown."""
    replace_file(os.path.join(out, "results.json"), json.dumps(results, indent=2))
    md = markdown(results)
    replace_file(os.path.join(out, "results.md"), md)
    return md
