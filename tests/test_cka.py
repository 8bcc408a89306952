"""cka.py: linear CKA against the Gram-matrix textbook formula in float64; invariances; end to end."""

import json
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from cka import linear_cka
from model import ModernBertConfig, ModernBertForMaskedLM
from support.tokenizer import train_bpe
from test_train import launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gram_cka(X, Y, debiased=False):
    """The textbook: K = X X^T and L = Y Y^T as n x n Gram matrices, HSIC ratio, float64.
    Biased: tr(KHLH) with the centring matrix H. Debiased: Song et al.'s unbiased HSIC on the
    Grams of column-centred features with zeroed diagonals."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    n = X.shape[0]
    # HKH = (HX)(HX)^T: centring the columns first changes nothing in exact arithmetic and
    # keeps the float64 reference accurate when features carry huge offsets.
    X, Y = X - X.mean(0), Y - Y.mean(0)
    K, L = X @ X.T, Y @ Y.T
    if not debiased:
        H = np.eye(n) - np.ones((n, n)) / n
        hsic = lambda K, L: np.trace(K @ H @ L @ H)  # noqa: E731
    else:
        np.fill_diagonal(K, 0)
        np.fill_diagonal(L, 0)
        one = np.ones(n)

        def hsic(K, L):
            return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
                    - 2 / (n - 2) * one @ K @ L @ one) / (n * (n - 3))
    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


@pytest.mark.parametrize("n,d1,d2", [(20, 50, 30), (300, 16, 24), (64, 64, 64)])
@pytest.mark.parametrize("debiased", [False, True])
def test_linear_cka_equals_gram_formula(n, d1, d2, debiased):
    rng = np.random.default_rng(n + d1)
    X = rng.normal(size=(n, d1)) + 3
    Y = X[:, :min(d1, d2)] @ rng.normal(size=(min(d1, d2), d2)) + 0.5 * rng.normal(size=(n, d2))
    assert linear_cka(X, Y, debiased) == pytest.approx(gram_cka(X, Y, debiased), abs=1e-10)


def test_invariances():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 32))
    Y = np.tanh(X @ rng.normal(size=(32, 40)))
    base = linear_cka(X, Y)
    assert linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(X, X, debiased=True) == pytest.approx(1.0, abs=1e-12)
    Q, _ = np.linalg.qr(rng.normal(size=(32, 32)))  # orthogonal
    assert linear_cka(X @ Q, Y) == pytest.approx(base, abs=1e-12)
    assert linear_cka(7.5 * X, 0.01 * Y) == pytest.approx(base, abs=1e-12)
    A = np.diag(np.geomspace(0.01, 100, 32)) @ rng.normal(size=(32, 32))  # invertible, not orthogonal
    assert abs(np.linalg.det(A)) > 0
    assert linear_cka(X @ A, X) < 0.9  # CKA is not invariant to arbitrary invertible maps


def test_float32_outlier_dimensions_give_the_float64_answer():
    rng = np.random.default_rng(1)
    n, d = 500, 64
    X = rng.normal(size=(n, d))
    X[:, :2] = 3e4 + 50 * rng.normal(size=(n, 2))  # a few huge dimensions with a large offset
    Y = X @ rng.normal(size=(d, d)) * 0.1 + rng.normal(size=(n, d))
    X32, Y32 = X.astype(np.float32), Y.astype(np.float32)
    exact = gram_cka(X32, Y32)  # float64 textbook on the very float32 values
    assert linear_cka(X32, Y32) == pytest.approx(exact, abs=1e-9)
    # Doing the same arithmetic in float32 goes wrong: this is the miscount the authors warn about.
    Xt, Yt = torch.tensor(X32), torch.tensor(Y32)
    naive = ((Yt.T @ Xt).square().sum() / torch.sqrt((Xt.T @ Xt).square().sum() * (Yt.T @ Yt).square().sum()))
    assert abs(naive.item() - exact) > 1e-3


# -----------------------------------------------------------------------------
# End to end on tiny checkpoints


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cka")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(120)]
    (tmp / "texts.txt").write_text("\n".join(texts))
    train_bpe(iter(texts), 300, str(tmp / "tokenizer.json"))
    torch.manual_seed(0)
    cfg = ModernBertConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                           num_attention_heads=2, local_attention=8, pad_token_id=0, cls_token_id=2, sep_token_id=3)
    model = ModernBertForMaskedLM(cfg)

    def save(m, name):
        m.save_pretrained(tmp / name)
        shutil.copyfile(tmp / "tokenizer.json", tmp / name / "tokenizer.json")
        return str(tmp / name)

    paths = {"a": save(model, "a"), "a_copy": save(model, "a_copy")}
    for eps in (0.002, 0.01, 0.05):
        noisy = ModernBertForMaskedLM(cfg)
        noisy.load_state_dict(model.state_dict())
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in noisy.parameters():
                p.add_(eps * torch.randn(p.shape, generator=g))
        paths[eps] = save(noisy, f"noisy{eps}")
    return tmp, paths


def run_cka(tmp, out, *args, nproc=1, check=True):
    cmd = launcher(nproc) + ["--"] * (nproc > 1)  # else torchrun reads cka.py's --n as one of its own options
    r = subprocess.run(cmd + [os.path.join(ROOT, "cka.py"), "--texts", str(tmp / "texts.txt"), "--n", "60",
                              "--seeds", "1,2", "--out", str(out), "--device", "cpu", *args],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out / "results.json") as f:
            return json.load(f)
    return r


def divergences(results, name="pair"):
    return [results["layers"][str(k)][f"{name}_divergence"]["mean"] for k in range(len(results["layers"]))]


def test_identical_checkpoints_diverge_nowhere_and_noise_grows(setup, tmp_path):
    tmp, paths = setup
    same = run_cka(tmp, tmp_path / "same", "--pair", paths["a"], paths["a_copy"])
    assert max(abs(d) for d in divergences(same)) < 1e-9
    means = [np.mean(divergences(run_cka(tmp, tmp_path / f"n{eps}", "--pair", paths["a"], paths[eps])))
             for eps in (0.002, 0.01, 0.05)]
    print("mean divergence vs perturbation 0.002/0.01/0.05:", ", ".join(f"{m:.4f}" for m in means))
    assert 0 < means[0] < means[1] < means[2]
    assert (tmp_path / "same" / "results.md").read_text().count("|") > 20
    assert (tmp_path / "same" / "divergence.png").is_file()


def test_torchrun_two_processes_equal_one(setup, tmp_path):
    tmp, paths = setup
    args = ["--pair", paths["a"], paths[0.01], "--control", paths["a"], paths[0.002]]
    one = run_cka(tmp, tmp_path / "one", *args)
    two = run_cka(tmp, tmp_path / "two", *args, nproc=2)
    for name in ("pair", "control"):
        assert np.allclose(divergences(one, name), divergences(two, name), atol=1e-6)
    assert one["regions"][0]["ratio"]["mean"] == pytest.approx(two["regions"][0]["ratio"]["mean"], rel=1e-4)


def test_token_pooling_runs(setup, tmp_path):
    tmp, paths = setup
    res = run_cka(tmp, tmp_path / "tok", "--pair", paths["a"], paths["a_copy"], "--pool", "tokens")
    assert max(abs(d) for d in divergences(res)) < 1e-9


def test_bad_inputs_are_clear(setup, tmp_path):
    tmp, paths = setup
    r = run_cka(tmp, tmp_path / "x", "--pair", paths["a"], paths["a_copy"], "--n", "500", check=False)
    assert r.returncode != 0 and "fewer than --n 500" in r.stderr
    other = tmp_path / "other_tok"
    shutil.copytree(paths["a"], other)
    train_bpe(iter(["completely different text corpus here"] * 30), 280, str(other / "tokenizer.json"))
    r = run_cka(tmp, tmp_path / "x", "--pair", paths["a"], str(other), check=False)
    assert r.returncode != 0 and "do not share a tokenizer" in r.stderr
    deeper = tmp_path / "deeper"
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=7, num_attention_heads=2)).save_pretrained(deeper)
    shutil.copyfile(tmp / "tokenizer.json", deeper / "tokenizer.json")
    r = run_cka(tmp, tmp_path / "x", "--pair", paths["a"], str(deeper), check=False)
    assert r.returncode != 0 and "layer count mismatch" in r.stderr


# -----------------------------------------------------------------------------
# Against an outside expectation: the paper's regions, and the table's numbers from the per-seed CKAs


def test_regions_are_the_papers_at_22_layers_and_thirds_otherwise():
    from cka import regions

    assert regions(22) == [(0, 8), (8, 15), (15, 22)]  # PAPER.md: layers 0-7, 8-14, 15-21 (French Base)
    assert regions(28) == [(0, 10), (10, 19), (19, 28)]  # Large: thirds, the larger first
    assert regions(6) == [(0, 2), (2, 4), (4, 6)]


def test_ratios_and_regions_are_computed_from_the_per_seed_divergences(setup, tmp_path):
    """results.json's summaries, recomputed here from its per-seed, per-layer CKAs: divergence = 1 - CKA; a
    layer's ratio is the mean over seeds of pair divergence / control divergence; a region's divergence is
    the mean over seeds of its layers' mean divergence (sample std over seeds), and its ratio that of the
    pair's region mean to the control's. Two processes against one cannot see a ratio turned upside down."""
    import cka

    tmp, paths = setup
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cka.main(["--pair", paths["a"], paths[0.05], "--control", paths["a"], paths[0.002], "--texts",
                  str(tmp / "texts.txt"), "--n", "60", "--seeds", "1,2,3", "--out", str(tmp_path), "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    res = json.loads((tmp_path / "results.json").read_text())
    seeds = ("1", "2", "3")
    div = {name: np.array([[1 - row["cka"] for row in res["per_seed"][name][s]] for s in seeds])
           for name in ("pair", "control")}  # (seeds, layers)
    for name in div:
        assert np.allclose(div[name], [[row["divergence"] for row in res["per_seed"][name][s]] for s in seeds])
    assert (div["pair"] > div["control"]).all()  # 0.05 noise against 0.002: a ratio above 1 everywhere
    for layer in range(6):
        entry = res["layers"][str(layer)]
        assert entry["ratio"]["mean"] == pytest.approx(np.mean(div["pair"][:, layer] / div["control"][:, layer]))
        assert entry["pair_divergence"]["mean"] == pytest.approx(div["pair"][:, layer].mean())
        assert entry["pair_divergence"]["std"] == pytest.approx(div["pair"][:, layer].std(ddof=1))
    assert [r["layers"] for r in res["regions"]] == ["0-1", "2-3", "4-5"]
    for region, (lo, hi) in zip(res["regions"], [(0, 2), (2, 4), (4, 6)]):
        means = {name: div[name][:, lo:hi].mean(axis=1) for name in div}  # per seed
        for name in div:
            assert region[f"{name}_divergence"]["mean"] == pytest.approx(means[name].mean())
            assert region[f"{name}_divergence"]["std"] == pytest.approx(means[name].std(ddof=1))
        assert region["ratio"]["mean"] == pytest.approx(means["pair"].mean() / means["control"].mean())
