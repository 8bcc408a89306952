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
the pair shows above the control is attributed to the objective.

Also per layer: debiased CKA (the U-statistic HSIC), and an outlier diagnostic
(the share of variance in the top 1% of dimensions, and CKA without them),
because a few huge dimensions can dominate linear CKA in deep layers.
Writes results.json, results.md and divergence.png (if matplotlib is installed).
"""

import argparse
import json
import math
import os

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from support import distributed
from support.checkpoint import sha256
from data import read_documents
from model import ModernBertForMaskedLM, cu_seqlens_of, mean_pool
from support.suite import mean_std
from support.tokenizer import load_tokenizer

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


def outlier_diagnostic(X, Y, top=0.01):
    """Share of total variance in the top 1% of dimensions (of X and of Y), and CKA without them."""
    X, Y = torch.as_tensor(X).double(), torch.as_tensor(Y).double()
    out = {}
    keep = []
    for name, Z in (("x", X), ("y", Y)):
        var = Z.var(0)
        k = max(1, math.ceil(top * Z.shape[1]))
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


def tokenizer_of(paths, override):
    """The one tokenizer every checkpoint shares: refuse if their tokenizer.json files differ."""
    if override:
        return load_tokenizer(override)
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
    return load_tokenizer(paths[0])


def ratio(pair, control):
    """Pair divergence over control divergence, per seed; None where the control does not diverge at all."""
    if min(control) < 1e-9:
        return None
    return mean_std([p / c for p, c in zip(pair, control)])


def study(args):
    """CKA per layer and seed for the pair and the control, and over seeds: results.json (None on ranks > 0)."""
    process = distributed.setup(args.device)
    rank, world, device = process.rank, process.world, process.device
    autocast, dtype = distributed.autocast(device, args.dtype)

    pairs = {"pair": args.pair, **({"control": args.control} if args.control else {})}
    paths = list(dict.fromkeys(p for pair in pairs.values() for p in pair))
    tok = tokenizer_of(paths, args.tokenizer)
    texts = list(read_documents([args.texts], args.text_field))
    if len(texts) < args.n:
        raise SystemExit(f"{args.texts} holds {len(texts)} texts, fewer than --n {args.n}")
    seeds = [int(s) for s in str(args.seeds).split(",")]
    draws = {s: np.random.default_rng(s).choice(len(texts), size=args.n, replace=False) for s in seeds}
    needed = sorted(set(np.concatenate(list(draws.values())).tolist()))
    mine = needed[rank::world]  # texts sharded across ranks
    ids = [[tok.cls_id] + tok.encode(texts[i])[:args.max_len - 2] + [tok.sep_id] for i in mine]

    features, n_layers = {}, None  # path -> list over layers of {text index: rows}
    for p in paths:
        model = ModernBertForMaskedLM.from_pretrained(p).to(device)
        if n_layers is not None and model.config.num_hidden_layers != n_layers:
            raise SystemExit(f"layer count mismatch: {p} has {model.config.num_hidden_layers} layers, "
                             f"{paths[0]} has {n_layers}; CKA compares layer i with layer i")
        if model.config.vocab_size < tok.vocab_size:
            raise SystemExit(f"{p} has {model.config.vocab_size} embeddings but the tokenizer {tok.vocab_size} ids")
        n_layers = model.config.num_hidden_layers
        if rank == 0:
            with autocast:
                backend = model.eval().model.attention_backend(device)
            print(f"{p}: {device}, {str(dtype).removeprefix('torch.')}, attention {backend}")
        local = pooled_layers(model, ids, mine, args.pool, device, autocast, args.batch_tokens, os.path.basename(p))
        if world > 1:  # only pooled vectors travel between ranks
            gathered = [None] * world
            dist.all_gather_object(gathered, local)
            local = [{k: v for part in gathered for k, v in part[layer].items()} for layer in range(n_layers)]
        features[p] = local
        del model

    results = {"settings": {**vars(args), "seeds": seeds, "n_layers": n_layers, "world_size": world,
                            "regions": regions(n_layers)}, "per_seed": {}, "layers": {}}
    for name, (a, b) in pairs.items():
        results["per_seed"][name] = {}
        for s in seeds:
            rows = []
            for layer in range(n_layers):
                X = np.concatenate([features[a][layer][i] for i in draws[s]])
                Y = np.concatenate([features[b][layer][i] for i in draws[s]])
                cka = linear_cka(X, Y)
                rows.append({"cka": cka, "divergence": 1 - cka, "cka_debiased": linear_cka(X, Y, debiased=True),
                             **outlier_diagnostic(X, Y)})
            results["per_seed"][name][str(s)] = rows
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
            region[f"{name}_divergence"] = mean_std([np.mean([results["per_seed"][name][str(s)][layer]["divergence"]
                                                              for layer in range(lo, hi)]) for s in seeds])
        if "control" in pairs:
            region["ratio"] = ratio([region["pair_divergence"]["mean"]], [region["control_divergence"]["mean"]])
        results["regions"].append(region)
    distributed.teardown()
    return results if rank == 0 else None


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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", nargs=2, required=True, metavar=("A", "B"), help="the two checkpoints under study")
    p.add_argument("--control", nargs=2, metavar=("C", "D"), help="two runs that differ only in seed")
    p.add_argument("--texts", required=True, help="held-out texts: .txt (one per line) or .jsonl")
    p.add_argument("--text_field", default="text")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seeds", default="42,43,44")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--pool", choices=["mean", "tokens"], default="mean",
                   help=f"mean: masked mean per text (the paper); tokens: {TOKENS_PER_TEXT} sampled tokens per text")
    p.add_argument("--tokenizer", help="when the checkpoints carry no tokenizer.json")
    p.add_argument("--batch_tokens", type=int, default=16384)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 autocast on GPU, float32 on CPU (CKA itself is computed in float64)")
    p.add_argument("--out", default="out/cka")
    args = p.parse_args(argv)
    results = study(args)
    if results is None:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    table = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    if figure(results, os.path.join(args.out, "divergence.png")):
        print(f"wrote {args.out}/results.json, results.md, divergence.png")


if __name__ == "__main__":
    main()
