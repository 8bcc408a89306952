"""
Layer-wise linear CKA between checkpoints: how the CLM detour changes the model.

    python cka.py --pair out/clm/final out/mlm/final --control out/mlm/final out/mlm_seed42/final \
                  --texts heldout.txt --n 500 --seeds 42,43,44 --out out/cka
    python cka.py --runs out/clm out/mlm --control out/mlm out/mlm_seed42 ...  # at every step both runs kept
    torchrun --nproc_per_node=4 -- cka.py ...   # texts sharded over GPUs ("--": --n is cka.py's, not torchrun's)

For every sampling seed, n held-out texts are drawn, truncated to max_len tokens, and run once through every model
(bidirectional). Each of the L layer outputs is mean-pooled per text (masked mean over its tokens), and linear CKA is
computed per layer in float64 between the two models of the pair (e.g. detour vs MLM) and of the control (two runs
that differ only in seed). Divergence = 1 - CKA; what the pair shows above the control is attributed to the
objective. The paper gives the 500 texts, the 3 seeds, the layer outputs and float64; the truncation to 512 tokens,
the mean pooling and the half-precision forward on GPU are our choice (its text as we have it does not say).
Also per layer: debiased CKA (the U-statistic HSIC), and an outlier diagnostic (the share of variance in the top 1%
of dimensions, and CKA without them), because a few huge dimensions can dominate linear CKA in deep layers.
Writes results.json, results.md and divergence.png (if matplotlib is installed); --runs: trajectory.json/.md/.png.
"""

import argparse
import json
import math
import os
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from support import processes, threads
from support.checkpoint import PROGRESS, checkpoint_config, step_checkpoints, step_of
from support.files import check_out_dir, open_file, read_json, replace_file, sha256, user_error, whole
from support.lock import hold
from data import read_documents
from model import ModernBertForMaskedLM, cu_seqlens_of, mean_pool
from support.suite import mean_std, parse_seeds
from support.tokenizer import check_vocab, load_tokenizer

# -----------------------------------------------------------------------------
# Linear CKA in feature space: only (d1 x d2) matrices, so n can be large.


def linear_cka(X, Y, debiased=False):
    """Linear CKA between X (n x d1) and Y (n x d2) in float64: ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F),
    columns centred (Kornblith et al. 2019); debiased: the same ratio of unbiased HSIC estimators (Song et al. 2012)."""
    X, Y = (torch.as_tensor(Z).to(torch.float64) for Z in (X, Y))
    X, Y = X - X.mean(0), Y - Y.mean(0)
    if not debiased:
        return ((Y.T @ X).square().sum() / torch.sqrt((X.T @ X).square().sum() * (Y.T @ Y).square().sum())).item()
    return (_hsic_u(X, Y) / torch.sqrt(_hsic_u(X, X) * _hsic_u(Y, Y))).item()


def _hsic_u(X, Y):
    """Unbiased HSIC (up to a constant that cancels in CKA) of K = X X^T and L = Y Y^T with zeroed diagonals:
    tr(K~L~) + (1'K~1)(1'L~1)/((n-1)(n-2)) - 2/(n-2) 1'K~L~1."""
    n = X.shape[0]
    kd, ld = X.square().sum(1), Y.square().sum(1)  # diagonals of K and L
    tr_kl = (Y.T @ X).square().sum() - (kd * ld).sum()
    k1, l1 = X @ X.sum(0) - kd, Y @ Y.sum(0) - ld  # K~ 1 and L~ 1, (n,)
    return tr_kl + k1.sum() * l1.sum() / ((n - 1) * (n - 2)) - 2 / (n - 2) * (k1 * l1).sum()


def outlier_diagnostic(X, Y):
    """Share of total variance in the top 1% of dimensions (of X and of Y), and CKA without them."""
    out, keep = {}, []
    for name, Z in zip("xy", (X, Y)):
        Z = torch.as_tensor(Z).double()
        var = Z.var(0)
        top_dims = var.topk(max(1, math.ceil(0.01 * Z.shape[1]))).indices
        out[f"top_var_share_{name}"] = (var[top_dims].sum() / var.sum()).item()
        keep.append(Z[:, ~torch.isin(torch.arange(Z.shape[1]), top_dims)])
    out["cka_without_top"] = linear_cka(*keep)
    return out


# -----------------------------------------------------------------------------
# Pooled layer outputs


def regions(n_layers):
    """Layer regions of the paper for 22 layers (0-7, 8-14, 15-21); thirds otherwise."""
    if n_layers == 22:
        return [(0, 8), (8, 15), (15, 22)]
    return [(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(n_layers), 3) if len(c)]


TOKENS_PER_TEXT = 8  # rows per text for pool="tokens"


@torch.no_grad()
def pooled_layers(model, encoded, indices, pool, device, autocast, batch_tokens, desc):
    """The texts `indices` (token ids `encoded`) through the model once -> per layer {text index: (r, H) float64}: r = 1
    for pool="mean"; for "tokens", up to TOKENS_PER_TEXT rows drawn by the text's index, the same for every model."""
    model.eval()
    out = [{} for _ in range(model.config.num_hidden_layers)]
    batches = [[]]  # similar lengths batch together: the texts by length, as many as batch_tokens holds padded
    for k in sorted(range(len(encoded)), key=lambda k: len(encoded[k])):
        if batches[-1] and (len(batches[-1]) + 1) * len(encoded[k]) > batch_tokens:
            batches.append([])
        batches[-1].append(k)
    for batch in tqdm(batches, desc=desc, disable=None, leave=False):
        threads.follow()
        lengths = [len(encoded[k]) for k in batch]
        tokens = torch.tensor([t for k in batch for t in encoded[k]], device=device)
        cu = cu_seqlens_of(lengths).to(device)
        with autocast:
            _, layers = model.model(tokens, cu, max(lengths), return_layers=True)
        starts = cu.tolist()
        rows = [[j] if pool == "mean" else starts[j] + np.sort(np.random.default_rng(indices[k]).choice(
            n, size=min(TOKENS_PER_TEXT, n), replace=False)) for j, (k, n) in enumerate(zip(batch, lengths))]
        for layer, h in enumerate(layers):  # h: (T, H)
            h = (mean_pool(h.float(), cu) if pool == "mean" else h).double().cpu().numpy()  # mean: (B, H)
            for k, r in zip(batch, rows):
                out[layer][indices[k]] = h[r]
    return out


# -----------------------------------------------------------------------------
# The study


def common_tokenizer_and_depth(paths, override, max_len):
    """-> the checkpoints' one tokenizer and one layer count: refused, before any model runs, if their tokenizer.json
    files or layer counts differ, or if one is not a ModernBERT checkpoint with max_len positions."""
    configs = {p: checkpoint_config(p, p) for p in paths}
    n_layers = configs[paths[0]].num_hidden_layers
    for p, config in configs.items():
        with user_error():
            config.check_positions(max_len, "--max_len {}", f"pass --max_len {config.max_position_embeddings} "
                                   "or less", whose=f"{p}'s ")
        if config.num_hidden_layers != n_layers:
            raise SystemExit(f"layer count mismatch: {p} has {config.num_hidden_layers} layers, the others "
                             f"{n_layers}; CKA compares layer i with layer i")
    if override:
        with user_error(f"--tokenizer {override}"):
            return load_tokenizer(override), n_layers
    if missing := [p for p in paths if not os.path.isfile(os.path.join(p, "tokenizer.json"))]:
        raise SystemExit(f"{missing[0]} has no tokenizer.json; pass --tokenizer (the one its data was prepared with)")
    hashes = {p: sha256(os.path.join(p, "tokenizer.json")) for p in paths}
    if len(set(hashes.values())) > 1:
        raise SystemExit("the checkpoints do not share a tokenizer (their tokenizer.json files differ): "
                         + ", ".join(f"{p}: {h[:12]}" for p, h in hashes.items()) + "; CKA compares the same texts "
                         "token for token, so all models must use one tokenizer")
    with user_error(paths[0]):
        return load_tokenizer(paths[0]), n_layers


def ratio(pair, control):
    """Pair divergence over control divergence, per seed; None where the control does not diverge at all."""
    return None if min(control) < 1e-9 else mean_std([p / c for p, c in zip(pair, control)])


def sample_texts(args, paths, process):
    """The texts every model sees, fixed by the texts and seeds alone: tok and n_layers (common_tokenizer_and_depth),
    the seeds, draws (seed -> n text indices), mine (the draws' union, sharded: this rank's to encode), their ids."""
    tok, n_layers = common_tokenizer_and_depth(paths, args.tokenizer, args.max_len)
    texts = list(read_documents([args.texts], args.text_field))
    if len(texts) < args.n:
        raise SystemExit(f"{args.texts} holds {len(texts)} texts, fewer than --n {args.n}: pass --n {len(texts)} or "
                         "fewer (the paper draws 500), or give more held-out texts")
    seeds = parse_seeds(args.seeds)
    draws = {s: np.random.default_rng(s).choice(len(texts), size=args.n, replace=False) for s in seeds}
    mine = sorted(set(np.concatenate(list(draws.values())).tolist()))[process.rank::process.world]
    ids = [[tok.cls_id] + x[:args.max_len - 2] + [tok.sep_id] for x in tok.encode_batch([texts[i] for i in mine])]
    return SimpleNamespace(tok=tok, n_layers=n_layers, seeds=seeds, draws=draws, mine=mine, ids=ids)


def representations(path, sample, args, process):
    """`path`'s pooled layer outputs for the sample, on every rank: per layer {text index: rows}."""
    autocast, dtype = processes.autocast(process.device, args.dtype)
    with user_error(path):  # weights cut short or of another shape
        model = ModernBertForMaskedLM.from_pretrained(path).place(process.device, dtype)
    check_vocab(sample.tok.vocab_size, model.config, "the tokenizer", path,
                "pass the tokenizer the models were trained with (--tokenizer)")
    if process.rank == 0 and not args.runs:  # a trajectory's progress bar says where it is
        backend = model.model.kernels.of(packed=False)  # texts of any length
        print(f"{path}: {process.device}, {str(dtype).removeprefix('torch.')}, attention {backend}"
              + threads.describe())
    local = pooled_layers(model, sample.ids, sample.mine, args.pool, process.device, autocast, args.batch_tokens,
                          "/".join(path.rstrip("/").split("/")[-2:]))
    if dist.is_initialized():  # only pooled vectors travel between ranks
        gathered = [None] * process.world
        dist.all_gather_object(gathered, local)
        local = [{k: v for part in gathered for k, v in part[layer].items()} for layer in range(len(local))]
    return local


def compare(fa, fb, sample, diagnostics=True):
    """{seed: per layer {cka, divergence, ...}} of two checkpoints' features (diagnostics: debiased, outliers)."""
    def row(X, Y):  # X, Y: (n * rows per text, H)
        cka = linear_cka(X, Y)
        extra = {"cka_debiased": linear_cka(X, Y, debiased=True), **outlier_diagnostic(X, Y)} if diagnostics else {}
        return {"cka": cka, "divergence": 1 - cka, **extra}
    return {str(s): [row(np.concatenate([fa[layer][i] for i in sample.draws[s]]),
                         np.concatenate([fb[layer][i] for i in sample.draws[s]])) for layer in range(len(fa))]
            for s in sample.seeds}


def region_divergence(per_seed, lo, hi):
    """Mean and std over seeds of the mean divergence of layers lo..hi-1."""
    return mean_std([np.mean([rows[layer]["divergence"] for layer in range(lo, hi)]) for rows in per_seed.values()])


def study(args, process, pairs):
    """CKA per layer and seed for the pair and the control, and over seeds: results.json."""
    paths = list(dict.fromkeys(p for pair in pairs.values() for p in pair))
    sample = sample_texts(args, paths, process)
    hold(args.out, process)  # one run writes --out at a time
    features = {p: representations(p, sample, args, process) for p in paths}  # path -> per layer {text index: rows}
    n_layers = sample.n_layers
    per_seed = {name: compare(features[a], features[b], sample) for name, (a, b) in pairs.items()}
    over_seeds = lambda name, layer, key: [rows[layer][key] for rows in per_seed[name].values()]  # noqa: E731
    keys = ("cka", "divergence", "cka_debiased", "cka_without_top", "top_var_share_x", "top_var_share_y")
    layers = {str(layer): {f"{name}_{key}": mean_std(over_seeds(name, layer, key)) for name in pairs for key in keys}
              for layer in range(n_layers)}
    spans = [{"layers": f"{lo}-{hi - 1}", **{f"{name}_divergence": region_divergence(per_seed[name], lo, hi)
                                             for name in pairs}} for lo, hi in regions(n_layers)]
    if "control" in pairs:
        for layer, entry in layers.items():
            entry["ratio"] = ratio(*(over_seeds(name, int(layer), "divergence") for name in ("pair", "control")))
        for region in spans:
            region["ratio"] = ratio([region["pair_divergence"]["mean"]], [region["control_divergence"]["mean"]])
    forward = str(processes.autocast(process.device, args.dtype)[1]).removeprefix("torch.")  # "auto" resolved
    return {"settings": {**vars(args), "forward_dtype": forward, "seeds": sample.seeds, "n_layers": n_layers,
                         "world_size": process.world, "regions": regions(n_layers)},
            "per_seed": per_seed, "layers": layers, "regions": spans}


# -----------------------------------------------------------------------------
# The trajectory: the same comparison at every step two runs both kept (cka.py --runs)


def run_checkpoints(run):
    """{step: checkpoint directory} of a run's out_dir: its ckpt-STEP (full or weights-only) and its final,
    which replaces the ckpt-STEP of its own step (the same weights)."""
    if not os.path.isdir(run):
        raise SystemExit(f"--runs/--control: {run} is not a directory (give a run's out_dir)")
    found = {step_of(p): p for p in step_checkpoints(run)}
    final = os.path.join(run, "final")
    if os.path.isdir(final):
        found[progress_of(final)["step"]] = final
    if not found:
        raise SystemExit(f"{run} holds no ckpt-STEP or final checkpoint: is it a train.py out_dir?")
    return found


def progress_of(ckpt):
    """The checkpoint's progress.json: its step, tokens (where known) and phase name (where known)."""
    try:
        progress = read_json(os.path.join(ckpt, PROGRESS))
        if not (whole(progress.get("step")) and whole(progress.get("tokens", 0))
                and isinstance(progress.get("phase", ""), str)):
            raise ValueError(f"step={progress.get('step')!r}, tokens={progress.get('tokens')!r} and "
                             f"phase={progress.get('phase')!r} must be two whole numbers and a phase name")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{ckpt}: no readable {PROGRESS} ({e}); train.py writes it with every checkpoint, "
                         "and a trajectory needs it to place the checkpoint (step, tokens, phase)") from None
    return progress


def trajectory(args, process, comparisons):
    """The pair's (and the control's) per-layer divergence at every step both of its runs kept, each step's
    numbers exactly those of --pair on the same two checkpoints. Each checkpoint is encoded once, for all
    the comparisons it is in, and dropped after its step: memory holds one step's representations."""
    kept = {run: run_checkpoints(run) for runs in comparisons.values() for run in runs}
    common = {}  # comparison -> the steps both its runs kept
    for name, (a, b) in comparisons.items():
        common[name] = sorted(set(kept[a]) & set(kept[b]))
        if not common[name]:
            raise SystemExit(f"{a} and {b} kept no checkpoint at a common step (steps {sorted(kept[a])} and "
                             f"{sorted(kept[b])}): train both with the same ckpt_interval or keep_every")
    sample = sample_texts(args, [kept[run][step] for name, runs in comparisons.items() for step in common[name]
                                 for run in runs], process)
    hold(args.out, process)  # one run writes --out at a time
    at_step = {step: {name: [kept[run][step] for run in runs] for name, runs in comparisons.items()
                      if step in common[name]} for step in sorted(set().union(*common.values()))}
    encode = {step: list(dict.fromkeys(p for paths in at.values() for p in paths)) for step, at in at_step.items()}
    bar = tqdm(total=sum(map(len, encode.values())), desc="checkpoints", unit="ckpt",
               disable=process.rank != 0 or None)
    points, n_layers = [], sample.n_layers
    for step, at in at_step.items():
        first = next(iter(at.values()))[0]  # the pair's first run, or the control's where the pair lacks the step
        point = {"step": step, **{k: progress_of(first).get(k) for k in ("tokens", "phase")},
                 **dict.fromkeys(comparisons)}
        features = {}  # checkpoint -> representations: a run in both comparisons is encoded once
        for p in encode[step]:
            features[p] = representations(p, sample, args, process)
            bar.update(1)
        for name, (a, b) in at.items():
            per_seed = compare(features[a], features[b], sample, diagnostics=False)
            point[name] = {"checkpoints": [a, b],
                           "layers": [region_divergence(per_seed, k, k + 1) for k in range(n_layers)],
                           "regions": [region_divergence(per_seed, lo, hi) for lo, hi in regions(n_layers)]}
        if point["pair"] and point.get("control"):
            point["ratio"] = [ratio([p["mean"]], [c["mean"]])
                              for p, c in zip(point["pair"]["regions"], point["control"]["regions"])]
        points.append(point)
        if process.rank == 0:  # one line per step, also where the bar is off (a pipe, a log file)
            pct = lambda name: " ".join(f"{100 * r['mean']:.2f}%" for r in point[name]["regions"]) \
                if point.get(name) else "-"  # noqa: E731
            tqdm.write(f"step {step} ({tokens_text(point['tokens'])} tokens, {point['phase']}): divergence by region, "
                       f"pair {pct('pair')}, control {pct('control')}")
    bar.close()
    return {"settings": {**vars(args), "seeds": sample.seeds, "n_layers": n_layers, "world_size": process.world,
                         "regions": [f"{lo}-{hi - 1}" for lo, hi in regions(n_layers)]}, "steps": points}


# -----------------------------------------------------------------------------
# Output: results.json, results.md, divergence.png


def ratio_text(r):
    return "n/a" if r is None else f"{r['mean']:.2f}x"


def markdown(results):
    control = "control" in results["per_seed"]
    pct = lambda s: f"{100 * s['mean']:.2f}% ± {100 * s['std']:.2f}"  # noqa: E731
    vs = lambda e: f" {pct(e['control_divergence'])} | {ratio_text(e['ratio'])} |" if control else ""  # noqa: E731
    return "\n".join([
        "## Per-layer divergence (1 - linear CKA), mean ± std over sampling seeds", "",
        "| layer | pair divergence | pair debiased CKA | pair CKA w/o top 1% dims | top-1% var share (A/B) |"
        + " control divergence | ratio |" * control, "|---|---|---|---|---|" + "---|---|" * control,
        *(f"| {layer} | {pct(e['pair_divergence'])} | {e['pair_cka_debiased']['mean']:.4f} | "
          f"{e['pair_cka_without_top']['mean']:.4f} | {e['pair_top_var_share_x']['mean']:.2f} / "
          f"{e['pair_top_var_share_y']['mean']:.2f} |" + vs(e) for layer, e in results["layers"].items()),
        "", "## Regions (mean divergence over the region's layers)", "",
        "| layers | pair |" + " control | ratio |" * control, "|---|---|" + "---|---|" * control,
        *(f"| {r['layers']} | {pct(r['pair_divergence'])} |" + vs(r) for r in results["regions"])]) + "\n"


def figure(results, plt):
    layers = np.array([int(k) for k in results["layers"]])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("pair", "C3"), ("control", "C0")):
        if name not in results["per_seed"]:
            continue
        m, s = (np.array([results["layers"][str(k)][f"{name}_divergence"][v] for k in layers]) for v in ("mean", "std"))
        a, b = ("/".join(x.rstrip("/").split("/")[-2:]) for x in results["settings"][name])
        ax.plot(layers, 100 * m, "o-", color=color, label=f"{name}: {a} vs {b}")
        ax.fill_between(layers, 100 * (m - s), 100 * (m + s), color=color, alpha=0.2)
    ax.set(xticks=layers, xlabel="layer", ylabel="divergence = 1 - CKA (%)",
           title="Layer-wise divergence (band: ± std over sampling seeds)")
    ax.legend()
    return fig


def tokens_text(tokens):
    return "?" if tokens is None else f"{tokens / 1e9:.3g}B" if tokens >= 1e9 else f"{tokens / 1e6:.3g}M" \
        if tokens >= 1e6 else f"{tokens / 1e3:.3g}k"


def trajectory_markdown(results):
    """Divergence by region against tokens, the control's beside it, and their ratio."""
    regions_ = results["settings"]["regions"]
    control = any(p.get("control") for p in results["steps"])
    pct = lambda s: "" if s is None else f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}"  # noqa: E731
    head = "".join(f" {r} pair (%) |" + f" {r} control (%) | {r} ratio |" * control for r in regions_)
    lines = ["## Divergence (1 - linear CKA) by layer region over training, mean ± std over sampling seeds", "",
             "pair: " + " vs ".join(results["settings"]["runs"]) + (
                 "; control: " + " vs ".join(results["settings"]["control"]) if control else ""), "",
             "| step | tokens | phase |" + head, "|---|---|---|" + "---|" * len(regions_) * (3 if control else 1)]
    for p in results["steps"]:
        row = f"| {p['step']} | {tokens_text(p['tokens'])} | {p['phase']} |"
        for k in range(len(regions_)):
            row += f" {pct(p['pair'] and p['pair']['regions'][k])} |"
            if control:
                row += (f" {pct(p['control'] and p['control']['regions'][k])} | "
                        f"{ratio_text(p['ratio'][k]) if p.get('ratio') else ''} |")
        lines.append(row)
    return "\n".join(lines) + "\n"


def trajectory_figure(results, plt):
    """Left: layers x checkpoints heat map of the pair's divergence, a line between the last checkpoint of a phase and
    the first of the next. Right: one curve per region against tokens, the pair solid and the control dashed."""
    points = [p for p in results["steps"] if p["pair"]]
    n_layers = results["settings"]["n_layers"]
    heat = 100 * np.array([[p["pair"]["layers"][k]["mean"] for p in points] for k in range(n_layers)])  # (L, steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    im = left.imshow(heat, aspect="auto", origin="lower", cmap="magma")
    fig.colorbar(im, ax=left, label="pair divergence (%)")
    left.set_xticks(range(len(points)), [tokens_text(p["tokens"]) for p in points], rotation=45, fontsize=8)
    left.set(xlabel="tokens (one column per compared checkpoint)", yticks=range(n_layers), ylabel="layer")
    left.set_title("pair: " + " vs ".join(os.path.basename(r.rstrip("/")) for r in results["settings"]["runs"]),
                   fontsize=10)
    ends = [k for k in range(len(points) - 1) if points[k]["phase"] != points[k + 1]["phase"]]
    for k in ends:
        left.axvline(k + 0.5, color="w", ls="--", lw=1.5)
        left.text(k + 0.55, n_layers - 0.6, f"{points[k + 1]['phase']} ->", color="w", fontsize=8, va="top")
    for k, (lo_hi, color) in enumerate(zip(results["settings"]["regions"], ("C0", "C1", "C2"))):
        for name, style in (("pair", "o-"), ("control", "s--")):
            if ps := [p for p in results["steps"] if p.get(name)]:
                right.plot([p["tokens"] for p in ps], [100 * p[name]["regions"][k]["mean"] for p in ps], style,
                           color=color, ms=4, label=f"layers {lo_hi}, {name}")
    for k in ends:  # the last kept checkpoint of the phase: the boundary itself when the phase end was kept
        right.axvline(points[k]["tokens"], color="k", ls=":", lw=1)
    right.set(xlabel="tokens", ylabel="mean divergence over the region (%)")
    right.set_title("by region: pair (solid) and control (dashed); dotted: end of a phase", fontsize=10)
    right.legend(fontsize=7)
    return fig


def write(out, stem, results, table, figure_of):
    """out/STEM.json, out/STEM.md (printed too) and, with matplotlib, the figure figure_of(results, pyplot)."""
    replace_file(os.path.join(out, f"{stem}.json"), json.dumps(results, indent=2))
    replace_file(os.path.join(out, f"{stem}.md"), table)
    print(table)
    png = {"results": "divergence.png", "trajectory": "trajectory.png"}[stem]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
        return
    fig = figure_of(results, plt)
    fig.tight_layout()
    with open_file(os.path.join(out, png), "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    print(f"wrote {out}/{stem}.json, {stem}.md, {png}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--pair", nargs=2, metavar=("A", "B"), help="the two checkpoints under study")
    what.add_argument("--runs", nargs=2, metavar=("RUN_A", "RUN_B"),
                      help="two runs' out_dirs: the pair at every step both kept (keep_every), and at their finals")
    p.add_argument("--control", nargs=2, metavar=("C", "D"),
                   help="two checkpoints (with --runs: two runs) that differ only in seed")
    p.add_argument("--texts", required=True, help="held-out texts: .txt (one per line) or .jsonl")
    p.add_argument("--text_field", default="text")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seeds", default="42,43,44")
    p.add_argument("--max_len", type=int, default=512, help="tokens per text (our choice)")
    p.add_argument("--pool", choices=["mean", "tokens"], default="mean",
                   help=f"mean: masked mean per text (our choice); tokens: {TOKENS_PER_TEXT} sampled tokens per text")
    p.add_argument("--tokenizer", help="when the checkpoints carry no tokenizer.json")
    p.add_argument("--batch_tokens", type=int, default=16384)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 autocast on GPU, float32 on CPU (CKA itself is computed in float64)")
    p.add_argument("--out", default="out/cka")
    args = p.parse_args(argv)
    if args.n < 4:
        p.error(f"--n {args.n}: CKA needs at least 4 texts (the debiased estimate divides by n - 2); "
                "a few hundred give a stable one")
    if parse_seeds(args.seeds) is None or args.max_len < 3:
        p.error(f"--seeds {args.seeds} --max_len {args.max_len}: seeds are integers like 42,43,44, and max_len "
                "holds [CLS], [SEP] and at least one token")
    check_out_dir(args.out)  # before the model passes: results are written there at the end
    return args


def main(argv=None):
    args = parse_args(argv)
    process = processes.setup(args.device)
    comparisons = {"pair": args.runs or args.pair, **({"control": args.control} if args.control else {})}
    results = (trajectory if args.runs else study)(args, process, comparisons)
    processes.teardown()
    if process.rank == 0 and args.runs:
        write(args.out, "trajectory", results, trajectory_markdown(results), trajectory_figure)
    elif process.rank == 0:
        write(args.out, "results", results, markdown(results), figure)


if __name__ == "__main__":
    main()
