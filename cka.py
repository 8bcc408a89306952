"""
Layer-wise linear CKA between checkpoints: how the CLM detour changes the model.

    python cka.py --pair out/clm/final out/mlm/final --control out/mlm/final out/mlm_seed42/final \
                  --texts heldout.txt --n 500 --seeds 42,43,44 --out out/cka
    torchrun --nproc_per_node=4 -- cka.py ...   # texts sharded over GPUs; the "--" keeps
                                                # torchrun from reading --n as its own option

For every sampling seed, n held-out texts are drawn, truncated to max_len tokens,
and run once through every model (bidirectional). Each of the L layer outputs is
mean-pooled per text (masked mean over its tokens), and linear CKA is computed
per layer in float64 between the two models of the pair (e.g. detour vs MLM) and
of the control (two runs that differ only in seed). Divergence = 1 - CKA; what
the pair shows above the control is attributed to the objective. The paper gives
the 500 texts, the 3 seeds, the layer outputs and float64; the truncation to 512
tokens, the mean pooling and the half-precision forward on GPU are our choice
(its text as we have it does not say).

Also per layer: debiased CKA (the U-statistic HSIC), and an outlier diagnostic
(the share of variance in the top 1% of dimensions, and CKA without them),
because a few huge dimensions can dominate linear CKA in deep layers.
Writes results.json, results.md and divergence.png (if matplotlib is installed).
"""

import argparse
import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from support import distributed, threads
from support.checkpoint import PROGRESS, sha256, step_checkpoints, step_of
from support.checks import checkpoint_config, user_error
from support.config import check_out_dir
from support.files import open_file, read_json, replace_file, whole
from support.lock import hold
from data import read_documents
from model import ModernBertForMaskedLM, cu_seqlens_of, mean_pool
from support.suite import mean_std, parse_seeds
from support.tokenizer import check_vocab, load_tokenizer

# -----------------------------------------------------------------------------
# Linear CKA in feature space: only (d1 x d2) matrices, so n can be large.


def linear_cka(X, Y, debiased=False):
    """Linear CKA between X (n x d1) and Y (n x d2), computed in float64.

    Biased: ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F) with column-centred Xc, Yc
    (Kornblith et al. 2019). Debiased: the same ratio of unbiased HSIC estimators
    (Song et al. 2012; Szekely-Rizzo), written with n x d sums instead of n x n Grams.
    """
    X = torch.as_tensor(X).to(torch.float64)
    Y = torch.as_tensor(Y).to(torch.float64)
    X, Y = X - X.mean(0), Y - Y.mean(0)
    if not debiased:
        xy = (Y.T @ X).square().sum()
        return (xy / torch.sqrt((X.T @ X).square().sum() * (Y.T @ Y).square().sum())).item()
    return (_hsic_u(X, Y) / torch.sqrt(_hsic_u(X, X) * _hsic_u(Y, Y))).item()


def _hsic_u(X, Y):
    """Unbiased HSIC (up to a constant that cancels in CKA) of K = X X^T and L = Y Y^T with zeroed diagonals:
    tr(K~L~) + (1'K~1)(1'L~1)/((n-1)(n-2)) - 2/(n-2) 1'K~L~1."""
    n = X.shape[0]
    kd, ld = X.square().sum(1), Y.square().sum(1)  # diagonals of K and L
    tr_kl = (Y.T @ X).square().sum() - (kd * ld).sum()
    k1 = X @ X.sum(0) - kd  # K~ 1, (n,)
    l1 = Y @ Y.sum(0) - ld
    return tr_kl + k1.sum() * l1.sum() / ((n - 1) * (n - 2)) - 2 / (n - 2) * (k1 * l1).sum()


def outlier_diagnostic(X, Y):
    """Share of total variance in the top 1% of dimensions (of X and of Y), and CKA without them."""
    X, Y = torch.as_tensor(X).double(), torch.as_tensor(Y).double()
    out = {}
    keep = []
    for name, Z in (("x", X), ("y", Y)):
        var = Z.var(0)
        k = max(1, math.ceil(0.01 * Z.shape[1]))
        top_dims = var.topk(k).indices
        out[f"top_var_share_{name}"] = (var[top_dims].sum() / var.sum()).item()
        mask = torch.ones(Z.shape[1], dtype=torch.bool)
        mask[top_dims] = False
        keep.append(Z[:, mask])
    out["cka_without_top"] = linear_cka(*keep)
    return out


# -----------------------------------------------------------------------------
# Pooled layer outputs


def regions(n_layers):
    """Layer regions of the paper for 22 layers (0-7, 8-14, 15-21); thirds otherwise."""
    if n_layers == 22:
        return [(0, 8), (8, 15), (15, 22)]
    cuts = np.array_split(np.arange(n_layers), 3)
    return [(int(c[0]), int(c[-1]) + 1) for c in cuts if len(c)]


TOKENS_PER_TEXT = 8  # rows per text for pool="tokens"


@torch.no_grad()
def pooled_layers(model, encoded, indices, pool, device, autocast, batch_tokens, desc):
    """Run the texts `indices` (token-id lists `encoded`) through the model once.

    Returns, per layer, {text index: (r, H) float64 array}: r = 1 for pool="mean" (masked mean
    over the text's tokens) or up to TOKENS_PER_TEXT token rows at positions fixed by the text
    index (the same for every model) for pool="tokens".
    """
    model.eval()
    out = [{} for _ in range(model.config.num_hidden_layers)]
    order = sorted(range(len(encoded)), key=lambda k: len(encoded[k]))  # similar lengths batch together
    batches, cur = [], []
    for k in order:
        if cur and (len(cur) + 1) * len(encoded[k]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(k)
    batches.append(cur)
    for batch in tqdm(batches, desc=desc, disable=None, leave=False):
        threads.follow()
        lengths = [len(encoded[k]) for k in batch]
        tokens = torch.tensor([t for k in batch for t in encoded[k]], device=device)
        cu = cu_seqlens_of(lengths).to(device)
        with autocast:
            _, layers = model.model(tokens, cu, max(lengths), return_layers=True)
        starts = cu.tolist()  # pool="tokens": the first row of each text
        for layer, h in enumerate(layers):  # h: (T, H)
            if pool == "mean":
                h = mean_pool(h.float(), cu).double().cpu().numpy()  # (B, H)
                for j, k in enumerate(batch):
                    out[layer][indices[k]] = h[j:j + 1]
            else:
                h = h.double().cpu().numpy()
                for j, k in enumerate(batch):
                    out[layer][indices[k]] = h[starts[j] + _token_sample(lengths[j], indices[k])]
    return out


def _token_sample(length, text_index):
    rng = np.random.default_rng(text_index)
    return np.sort(rng.choice(length, size=min(TOKENS_PER_TEXT, length), replace=False))


# -----------------------------------------------------------------------------
# The study


def tokenizer_of(paths, override, max_len):
    """The one tokenizer every checkpoint shares: refuse if their tokenizer.json files differ, or if one is not a
    ModernBERT checkpoint with max_len positions."""
    for p in paths:
        config = checkpoint_config(p, p)
        with user_error():
            config.check_positions(max_len, "--max_len {}", f"pass --max_len {config.max_position_embeddings} "
                                   "or less", whose=f"{p}'s ")
    if override:
        try:
            return load_tokenizer(override)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--tokenizer {override}: {e}") from None
    hashes = {}
    for p in paths:
        f = os.path.join(p, "tokenizer.json")
        if not os.path.isfile(f):
            raise SystemExit(f"{p} has no tokenizer.json; pass --tokenizer (the tokenizer its data was prepared with)")
        hashes[p] = sha256(f)
    if len(set(hashes.values())) > 1:
        raise SystemExit("the checkpoints do not share a tokenizer (their tokenizer.json files differ): "
                         + ", ".join(f"{p}: {h[:12]}" for p, h in hashes.items()) + "; CKA compares the same texts "
                         "token for token, so all models must use one tokenizer")
    with user_error(paths[0]):
        return load_tokenizer(paths[0])


def ratio(pair, control):
    """Pair divergence over control divergence, per seed; None where the control does not diverge at all."""
    if min(control) < 1e-9:
        return None
    return mean_std([p / c for p, c in zip(pair, control)])


@dataclass
class Sample:
    """The texts every model sees: per sampling seed the n text indices drawn, and this rank's share of
    their union, tokenized. Fixed by the texts and seeds alone, so every checkpoint sees the same."""
    seeds: list
    draws: dict  # seed -> n text indices
    mine: list  # the indices this rank encodes (the union sharded across ranks)
    ids: list  # their token ids: [CLS] text[:max_len - 2] [SEP]


def sample_texts(args, tok, process):
    texts = list(read_documents([args.texts], args.text_field))
    if len(texts) < args.n:
        raise SystemExit(f"{args.texts} holds {len(texts)} texts, fewer than --n {args.n}: pass --n {len(texts)} or "
                         "fewer (the paper draws 500), or give more held-out texts")
    seeds = parse_seeds(args.seeds)
    draws = {s: np.random.default_rng(s).choice(len(texts), size=args.n, replace=False) for s in seeds}
    needed = sorted(set(np.concatenate(list(draws.values())).tolist()))
    mine = needed[process.rank::process.world]  # texts sharded across ranks
    ids = [[tok.cls_id] + tok.encode(texts[i])[:args.max_len - 2] + [tok.sep_id] for i in mine]
    return Sample(seeds, draws, mine, ids)


def representations(path, sample, tok, args, process, n_layers=None):
    """Checkpoint `path`'s pooled layer outputs for the sample, on every rank: a list over layers of
    {text index: rows}. `n_layers`: the layer count the other checkpoints have."""
    autocast, dtype = distributed.autocast(process.device, args.dtype)
    with user_error(path):  # weights cut short or of another shape
        model = ModernBertForMaskedLM.from_pretrained(path).to(process.device)
    if n_layers is not None and model.config.num_hidden_layers != n_layers:
        raise SystemExit(f"layer count mismatch: {path} has {model.config.num_hidden_layers} layers, "
                         f"the others {n_layers}; CKA compares layer i with layer i")
    check_vocab(tok.vocab_size, model.config, "the tokenizer", path, "pass the tokenizer the models were trained with "
                "(--tokenizer)")
    n_layers = model.config.num_hidden_layers
    if process.rank == 0 and not args.runs:  # a trajectory's progress bar says where it is
        with autocast:
            backend = model.eval().model.attention_backend(process.device, packed=False)  # texts of any length
        print(f"{path}: {process.device}, {str(dtype).removeprefix('torch.')}, attention {backend}"
              + threads.describe())
    name = "/".join(path.rstrip("/").split("/")[-2:])
    local = pooled_layers(model, sample.ids, sample.mine, args.pool, process.device, autocast, args.batch_tokens, name)
    if dist.is_initialized():  # only pooled vectors travel between ranks
        gathered = [None] * process.world
        dist.all_gather_object(gathered, local)
        local = [{k: v for part in gathered for k, v in part[layer].items()} for layer in range(n_layers)]
    return local


def compare(fa, fb, sample, diagnostics=True):
    """{seed: per layer {cka, divergence, ...}} between two checkpoints' representations, in float64.
    diagnostics: also the debiased CKA and the outlier diagnostic."""
    per_seed = {}
    for s in sample.seeds:
        rows = []
        for layer in range(len(fa)):
            X = np.concatenate([fa[layer][i] for i in sample.draws[s]])  # (n * rows per text, H)
            Y = np.concatenate([fb[layer][i] for i in sample.draws[s]])
            cka = linear_cka(X, Y)
            row = {"cka": cka, "divergence": 1 - cka}
            if diagnostics:
                row.update(cka_debiased=linear_cka(X, Y, debiased=True), **outlier_diagnostic(X, Y))
            rows.append(row)
        per_seed[str(s)] = rows
    return per_seed


def region_divergence(per_seed, lo, hi):
    """Mean and std over seeds of the mean divergence of layers lo..hi-1."""
    return mean_std([np.mean([rows[layer]["divergence"] for layer in range(lo, hi)]) for rows in per_seed.values()])


def study(args):
    """CKA per layer and seed for the pair and the control, and over seeds: results.json (None on ranks > 0)."""
    process = distributed.setup(args.device)
    threads.setup(process.device)
    pairs = {"pair": args.pair, **({"control": args.control} if args.control else {})}
    paths = list(dict.fromkeys(p for pair in pairs.values() for p in pair))
    tok = tokenizer_of(paths, args.tokenizer, args.max_len)
    sample = sample_texts(args, tok, process)
    hold(args.out, process)  # one run writes --out at a time
    features, n_layers = {}, None  # path -> list over layers of {text index: rows}
    for p in paths:
        features[p] = representations(p, sample, tok, args, process, n_layers)
        n_layers = len(features[p])

    seeds = sample.seeds
    results = {"settings": {**vars(args), "seeds": seeds, "n_layers": n_layers, "world_size": process.world,
                            "regions": regions(n_layers)}, "per_seed": {}, "layers": {}}
    for name, (a, b) in pairs.items():
        results["per_seed"][name] = compare(features[a], features[b], sample)
    for layer in range(n_layers):
        entry = {}
        for name in pairs:
            for key in ("cka", "divergence", "cka_debiased", "cka_without_top", "top_var_share_x", "top_var_share_y"):
                entry[f"{name}_{key}"] = mean_std([results["per_seed"][name][str(s)][layer][key] for s in seeds])
        if "control" in pairs:
            entry["ratio"] = ratio([results["per_seed"]["pair"][str(s)][layer]["divergence"] for s in seeds],
                                   [results["per_seed"]["control"][str(s)][layer]["divergence"] for s in seeds])
        results["layers"][str(layer)] = entry
    results["regions"] = []
    for lo, hi in regions(n_layers):
        region = {"layers": f"{lo}-{hi - 1}"}
        for name in pairs:
            region[f"{name}_divergence"] = region_divergence(results["per_seed"][name], lo, hi)
        if "control" in pairs:
            region["ratio"] = ratio([region["pair_divergence"]["mean"]], [region["control_divergence"]["mean"]])
        results["regions"].append(region)
    distributed.teardown()
    return results if process.rank == 0 else None


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


def trajectory(args):
    """The pair's (and the control's) per-layer divergence at every step both of its runs kept, each step's
    numbers exactly those of --pair on the same two checkpoints. Each checkpoint is encoded once, for all
    the comparisons it is in, and dropped after its step: memory holds one step's representations."""
    process = distributed.setup(args.device)
    threads.setup(process.device)
    comparisons = {"pair": args.runs, **({"control": args.control} if args.control else {})}
    kept = {run: run_checkpoints(run) for runs in comparisons.values() for run in runs}
    common = {}  # comparison -> the steps both its runs kept
    for name, (a, b) in comparisons.items():
        common[name] = sorted(set(kept[a]) & set(kept[b]))
        if not common[name]:
            raise SystemExit(f"{a} and {b} kept no checkpoint at a common step (steps {sorted(kept[a])} and "
                             f"{sorted(kept[b])}): train both with the same ckpt_interval or keep_every")
    steps = sorted(set().union(*common.values()))
    tok = tokenizer_of([kept[run][step] for name, runs in comparisons.items() for step in common[name]
                        for run in runs], args.tokenizer, args.max_len)
    sample = sample_texts(args, tok, process)
    hold(args.out, process)  # one run writes --out at a time
    todo = sum(len({kept[run][step] for name, runs in comparisons.items() if step in common[name] for run in runs})
               for step in steps)
    bar = tqdm(total=todo, desc="checkpoints", unit="ckpt", disable=process.rank != 0 or None)
    points, n_layers = [], None
    for step in steps:
        features = {}  # checkpoint -> representations: a run in both comparisons is encoded once
        first = comparisons["pair"][0] if step in common["pair"] else comparisons["control"][0]
        point = {"step": step, **{k: progress_of(kept[first][step]).get(k) for k in ("tokens", "phase")}}
        for name, runs in comparisons.items():
            if step not in common[name]:
                point[name] = None
                continue
            paths = [kept[run][step] for run in runs]
            for p in paths:
                if p not in features:
                    features[p] = representations(p, sample, tok, args, process, n_layers)
                    n_layers = len(features[p])
                    bar.update(1)
            per_seed = compare(features[paths[0]], features[paths[1]], sample, diagnostics=False)
            point[name] = {"checkpoints": paths,
                           "layers": [mean_std([rows[layer]["divergence"] for rows in per_seed.values()])
                                      for layer in range(n_layers)],
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
    results = {"settings": {**vars(args), "seeds": sample.seeds, "n_layers": n_layers, "world_size": process.world,
                            "regions": [f"{lo}-{hi - 1}" for lo, hi in regions(n_layers)]}, "steps": points}
    distributed.teardown()
    return results if process.rank == 0 else None


# -----------------------------------------------------------------------------
# Output: results.json, results.md, divergence.png


def ratio_text(r):
    return "n/a" if r is None else f"{r['mean']:.2f}x"


def markdown(results):
    has_control = "control" in results["per_seed"]
    head = "| layer | pair divergence | pair debiased CKA | pair CKA w/o top 1% dims | top-1% var share (A/B) |"
    sep = "|---|---|---|---|---|"
    if has_control:
        head += " control divergence | ratio |"
        sep += "---|---|"
    lines = ["## Per-layer divergence (1 - linear CKA), mean ± std over sampling seeds", "", head, sep]
    pct = lambda s: f"{100 * s['mean']:.2f}% ± {100 * s['std']:.2f}"  # noqa: E731
    for layer, e in results["layers"].items():
        row = (f"| {layer} | {pct(e['pair_divergence'])} | {e['pair_cka_debiased']['mean']:.4f} | "
               f"{e['pair_cka_without_top']['mean']:.4f} | {e['pair_top_var_share_x']['mean']:.2f} / "
               f"{e['pair_top_var_share_y']['mean']:.2f} |")
        if has_control:
            row += f" {pct(e['control_divergence'])} | {ratio_text(e['ratio'])} |"
        lines.append(row)
    lines += ["", "## Regions (mean divergence over the region's layers)", "",
              "| layers | pair | control | ratio |" if has_control else "| layers | pair |",
              "|---|---|---|---|" if has_control else "|---|---|"]
    for r in results["regions"]:
        row = f"| {r['layers']} | {pct(r['pair_divergence'])} |"
        if has_control:
            row += f" {pct(r['control_divergence'])} | {ratio_text(r['ratio'])} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def figure(results, path):
    plt = pyplot()
    if plt is None:
        return False
    layers = np.array([int(k) for k in results["layers"]])
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("pair", "C3"), ("control", "C0")):
        if name not in results["per_seed"]:
            continue
        m = np.array([results["layers"][str(k)][f"{name}_divergence"]["mean"] for k in layers])
        s = np.array([results["layers"][str(k)][f"{name}_divergence"]["std"] for k in layers])
        a, b = ("/".join(x.rstrip("/").split("/")[-2:]) for x in results["settings"][name])
        ax.plot(layers, 100 * m, "o-", color=color, label=f"{name}: {a} vs {b}")
        ax.fill_between(layers, 100 * (m - s), 100 * (m + s), color=color, alpha=0.2)
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("divergence = 1 - CKA (%)")
    ax.set_title("Layer-wise divergence (band: ± std over sampling seeds)")
    ax.legend()
    fig.tight_layout()
    with open_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return True


def tokens_text(tokens):
    return "?" if tokens is None else f"{tokens / 1e9:.3g}B" if tokens >= 1e9 else f"{tokens / 1e6:.3g}M" \
        if tokens >= 1e6 else f"{tokens / 1e3:.3g}k"


def trajectory_markdown(results):
    """Divergence by region against tokens, the control's beside it, and their ratio."""
    regions_ = results["settings"]["regions"]
    has_control = any(p.get("control") for p in results["steps"])
    pct = lambda s: "" if s is None else f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}"  # noqa: E731
    head, sep = "| step | tokens | phase |", "|---|---|---|"
    for r in regions_:
        head += f" {r} pair (%) |" + (f" {r} control (%) | {r} ratio |" if has_control else "")
        sep += "---|" * (3 if has_control else 1)
    lines = ["## Divergence (1 - linear CKA) by layer region over training, mean ± std over sampling seeds", "",
             "pair: " + " vs ".join(results["settings"]["runs"]) + (
                 "; control: " + " vs ".join(results["settings"]["control"]) if has_control else ""),
             "", head, sep]
    for p in results["steps"]:
        row = f"| {p['step']} | {tokens_text(p['tokens'])} | {p['phase']} |"
        for k in range(len(regions_)):
            row += f" {pct(p['pair'] and p['pair']['regions'][k])} |"
            if has_control:
                ratio_ = p.get("ratio") and p["ratio"][k]
                control = pct(p["control"] and p["control"]["regions"][k])
                row += f" {control} | {ratio_text(ratio_) if p.get('ratio') else ''} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def trajectory_figure(results, path):
    """Left: layers x checkpoints heat map of the pair's divergence, the phase boundary as a line between
    the last checkpoint of a phase and the first of the next. Right: one curve per region against tokens,
    the pair solid and the control dashed beside it."""
    plt = pyplot()
    if plt is None:
        return False
    points = [p for p in results["steps"] if p["pair"]]
    n_layers = results["settings"]["n_layers"]
    heat = 100 * np.array([[p["pair"]["layers"][k]["mean"] for p in points] for k in range(n_layers)])  # (L, steps)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    im = left.imshow(heat, aspect="auto", origin="lower", cmap="magma")
    fig.colorbar(im, ax=left, label="pair divergence (%)")
    left.set_xticks(range(len(points)), [tokens_text(p["tokens"]) for p in points], rotation=45, fontsize=8)
    left.set_xlabel("tokens (one column per compared checkpoint)")
    left.set_yticks(range(n_layers))
    left.set_ylabel("layer")
    left.set_title("pair: " + " vs ".join(os.path.basename(r.rstrip("/")) for r in results["settings"]["runs"]),
                   fontsize=10)
    ends = [k for k in range(len(points) - 1) if points[k]["phase"] != points[k + 1]["phase"]]
    for k in ends:
        left.axvline(k + 0.5, color="w", ls="--", lw=1.5)
        left.text(k + 0.55, n_layers - 0.6, f"{points[k + 1]['phase']} ->", color="w", fontsize=8, va="top")
    for k, (lo_hi, color) in enumerate(zip(results["settings"]["regions"], ("C0", "C1", "C2"))):
        for name, style in (("pair", "o-"), ("control", "s--")):
            ps = [p for p in results["steps"] if p.get(name)]
            if ps:
                right.plot([p["tokens"] for p in ps], [100 * p[name]["regions"][k]["mean"] for p in ps], style,
                           color=color, ms=4, label=f"layers {lo_hi}, {name}")
    for k in ends:  # the last kept checkpoint of the phase: the boundary itself when the phase end was kept
        right.axvline(points[k]["tokens"], color="k", ls=":", lw=1)
    right.set_xlabel("tokens")
    right.set_ylabel("mean divergence over the region (%)")
    right.set_title("by region: pair (solid) and control (dashed); dotted: end of a phase", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    with open_file(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return True


def pyplot():
    """matplotlib's pyplot without a display, or None (and a line saying so) if it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
        return None
    return plt


def write(out, stem, results, table, figure_of):
    """out/STEM.json, out/STEM.md (printed too) and the figure."""
    os.makedirs(out, exist_ok=True)
    replace_file(os.path.join(out, f"{stem}.json"), json.dumps(results, indent=2))
    replace_file(os.path.join(out, f"{stem}.md"), table)
    print(table)
    png = {"results": "divergence.png", "trajectory": "trajectory.png"}[stem]
    if figure_of(results, os.path.join(out, png)):
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
    if args.runs:
        results = trajectory(args)
        if results is not None:
            write(args.out, "trajectory", results, trajectory_markdown(results), trajectory_figure)
    else:
        results = study(args)
        if results is not None:
            write(args.out, "results", results, markdown(results), figure)


if __name__ == "__main__":
    main()
