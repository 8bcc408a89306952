"""cka.py: linear CKA against the Gram-matrix textbook formula in float64; invariances; end to end."""

import contextlib
import io
import json
import os
import random
import shutil
import subprocess

import pytest
import torch
from tokenizers import Tokenizer

import numpy as np
import cka
from cka import linear_cka
from model import ModernBertConfig, ModernBertForMaskedLM
from support.checkpoint import latest_valid_checkpoint, step_checkpoints, weights_only
from support.tokenizer import train_bpe
from test_train import TIMINGS, base_ckpt, data_dir, launcher, metrics, train_here  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gram_cka(X, Y, debiased=False):
    """The textbook in float64: HSIC ratio of the n x n Grams K = X X^T, L = Y Y^T. Biased: tr(KHLH) with the
    centring matrix H; debiased: Song et al.'s unbiased HSIC, the Grams' diagonals zeroed."""
    # HKH = (HX)(HX)^T: centring the columns first changes nothing in exact arithmetic and
    # keeps the float64 reference accurate when features carry huge offsets.
    X, Y = (Z - Z.mean(0) for Z in (np.asarray(X, np.float64), np.asarray(Y, np.float64)))
    n, one = len(X), np.ones(len(X))
    K, L = X @ X.T, Y @ Y.T
    if debiased:
        K, L = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))

    def hsic(K, L):
        if not debiased:
            return np.trace(K @ (np.eye(n) - 1 / n) @ L @ (np.eye(n) - 1 / n))
        return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
                - 2 / (n - 2) * one @ K @ L @ one) / (n * (n - 3))
    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


@pytest.mark.parametrize("n,d1,d2", [(20, 50, 30), (300, 16, 24), (64, 64, 64)])
@pytest.mark.parametrize("debiased", [False, True])
def test_linear_cka_equals_gram_formula_and_its_invariances(n, d1, d2, debiased):
    rng = np.random.default_rng(n + d1)
    X = rng.normal(size=(n, d1)) + 3
    Y = X[:, :min(d1, d2)] @ rng.normal(size=(min(d1, d2), d2)) + 0.5 * rng.normal(size=(n, d2))
    cka_xy = linear_cka(X, Y, debiased)
    assert cka_xy == pytest.approx(gram_cka(X, Y, debiased), abs=1e-10)
    Q, _ = np.linalg.qr(rng.normal(size=(d1, d1)))  # orthogonal
    assert linear_cka(7.5 * X @ Q, 0.01 * Y, debiased) == pytest.approx(cka_xy, abs=1e-10)  # rotation, scale
    assert linear_cka(X, X, debiased) == pytest.approx(1.0, abs=1e-12)


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


def cka_args(texts_dir, out, *args):
    """cka.py's arguments on texts_dir/texts.txt: 40 texts, 2 sampling seeds, 48 tokens per text."""
    return [str(a) for a in ("--texts", texts_dir / "texts.txt", "--n", 40, "--seeds", "1,2", "--max_len", 48,
                             "--device", "cpu", "--out", out, *args)]


def run_cka(texts_dir, out, *args):
    """cka.py in this process: -> the results.json or trajectory.json it wrote."""
    cka.main(cka_args(texts_dir, out, *args))
    return json.loads((out / ("trajectory.json" if "--runs" in args else "results.json")).read_text())


def divergences(results, name="pair"):
    return [results["layers"][str(k)][f"{name}_divergence"]["mean"] for k in range(len(results["layers"]))]


@pytest.fixture(scope="module")
def one_process(setup, tmp_path_factory):
    """The pair: 0.05 noise; the control: 0.002 noise."""
    tmp, paths = setup
    return run_cka(tmp, tmp_path_factory.mktemp("one"), "--pair", paths["a"], paths[0.05], "--control", paths["a"],
                   paths[0.002])


def test_identical_checkpoints_diverge_nowhere_and_noise_grows(setup, one_process, tmp_path):
    tmp, paths = setup
    same = run_cka(tmp, tmp_path, "--pair", paths["a"], paths["a_copy"], "--control", paths["a"], paths[0.01])
    tokens = run_cka(tmp, tmp_path / "tokens", "--pair", paths["a"], paths["a_copy"], "--pool", "tokens")
    assert max(abs(d) for d in divergences(same) + divergences(tokens)) < 1e-9
    means = [np.mean(d) for d in (divergences(one_process, "control"), divergences(same, "control"),
                                  divergences(one_process, "pair"))]
    print("mean divergence vs perturbation 0.002/0.01/0.05:", ", ".join(f"{m:.4f}" for m in means))
    assert 0 < means[0] < means[1] < means[2]
    assert (tmp_path / "results.md").read_text().count("|") > 20
    assert (tmp_path / "divergence.png").is_file()


def test_torchrun_two_processes_equal_one(setup, one_process, tmp_path):
    tmp, settings = setup[0], one_process["settings"]
    # "--": else torchrun reads cka.py's --n as one of its own options
    r = subprocess.run(launcher(2) + ["--", os.path.join(ROOT, "cka.py"), *cka_args(
        tmp, tmp_path, "--pair", *settings["pair"], "--control", *settings["control"])],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads((tmp_path / "results.json").read_text())
    for name in ("pair", "control"):
        assert np.allclose(divergences(one_process, name), divergences(two, name), atol=1e-6)
    assert one_process["regions"][0]["ratio"]["mean"] == pytest.approx(two["regions"][0]["ratio"]["mean"], rel=1e-4)


def test_bad_inputs_are_clear(setup, tmp_path):
    tmp, paths = setup
    with pytest.raises(SystemExit, match="fewer than --n 500"):
        run_cka(tmp, tmp_path, "--pair", paths["a"], paths["a_copy"], "--n", "500")
    other = tmp_path / "other_tok"
    shutil.copytree(paths["a"], other)
    train_bpe(iter(["completely different text corpus here"] * 30), 280, str(other / "tokenizer.json"))
    with pytest.raises(SystemExit, match="do not share a tokenizer"):
        run_cka(tmp, tmp_path, "--pair", paths["a"], other)
    deeper = tmp_path / "deeper"
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=320, hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=7, num_attention_heads=2)).save_pretrained(deeper)
    shutil.copyfile(tmp / "tokenizer.json", deeper / "tokenizer.json")
    with pytest.raises(SystemExit, match="layer count mismatch"):
        run_cka(tmp, tmp_path, "--pair", paths["a"], deeper)


# -----------------------------------------------------------------------------
# Against an outside expectation: the paper's regions, and the table's numbers from the per-seed CKAs


def test_regions_and_ratios_are_the_papers_from_the_per_seed_divergences(one_process):
    """results.json's summaries from its per-seed CKAs: a layer's ratio is the mean over seeds of pair / control, a
    region's the ratio of their means (two processes against one cannot see a ratio turned upside down)."""
    assert cka.regions(22) == [(0, 8), (8, 15), (15, 22)]  # PAPER.md: layers 0-7, 8-14, 15-21 (French Base)
    assert cka.regions(28) == [(0, 10), (10, 19), (19, 28)]  # Large: thirds, the larger first
    res, seeds = one_process, ("1", "2")
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


# ---------------------------------------------------------------------------------------------------------------------
# keep_every and cka.py --runs: checkpoints kept for a trajectory survive max_ckpts weights-only, resume ignores
# them; the trajectory over two tiny runs equals --pair and the float64 textbook on transformers' forward.

# 16 main + 4 decay steps (test_train's tiny run). Full checkpoints every 8 steps and at each phase end, the
# newest 2 kept; every 6th step kept weights-only: 6, 12 and 18 are trajectory points only.
KEEP = ["--keep_every=6", "--max_ckpts=2", "--ckpt_interval=8", "--eval_interval=100", "--log_interval=4"]
ARMS = {"clm": ["--objective=clm"], "mlm": ["--objective=mlm"], "mlm_twin": ["--objective=mlm", "--seed=42"]}


@pytest.fixture(scope="module")
def runs(data_dir, base_ckpt, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("runs")
    for name in ARMS:
        train_here(tmp / name, data_dir, f"--init_from={base_ckpt}", *KEEP, *ARMS[name])
    rng = random.Random(1)
    nouns, verbs = ["cell", "gene", "protein", "tumor", "patient", "dose", "virus"], ["binds", "inhibits", "treats"]
    texts = [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} a {rng.choice(nouns)}."
                      for _ in range(rng.randint(1, 5))) for _ in range(60)]
    (tmp / "texts.txt").write_text("\n".join(texts))
    return tmp


def steps_in(run):
    return {int(os.path.basename(p).split("-")[1]): weights_only(p) for p in step_checkpoints(str(run))}


def test_resume_picks_the_newest_full_checkpoint_not_a_weights_only_one(runs, data_dir, base_ckpt, tmp_path):  # noqa: F811
    # The out_dir as a kill between steps 18 and 20 leaves it: the newest checkpoint is weights-only. And ckpt-12 as a
    # kill inside its pruning leaves it: train_state.pt removed, its manifest still listing it (the next prune ends it).
    run = tmp_path / "clm"
    shutil.copytree(runs / "clm", run)
    shutil.rmtree(run / "final")
    shutil.rmtree(run / "ckpt-20")
    manifest = json.loads((run / "ckpt-16" / "manifest.json").read_text())
    half = {**json.loads((run / "ckpt-12" / "manifest.json").read_text()), "train_state.pt": manifest["train_state.pt"]}
    (run / "ckpt-12" / "manifest.json").write_text(json.dumps(half))
    assert latest_valid_checkpoint(str(run)) == str(run / "ckpt-16")
    assert "resuming at step 16" in train_here(run, data_dir, f"--init_from={base_ckpt}", *KEEP, *ARMS["clm"]).stdout
    strip = lambda records: [{k: v for k, v in m.items() if k not in TIMINGS} for m in records]  # noqa: E731
    assert strip(metrics(run)) == strip(metrics(runs / "clm"))
    assert steps_in(run) == steps_in(runs / "clm")
    for name in ("model.safetensors", "progress.json"):
        assert (run / "final" / name).read_bytes() == (runs / "clm" / "final" / name).read_bytes()


@pytest.fixture(scope="module")
def trajectory(runs):
    with contextlib.redirect_stdout(io.StringIO()) as said:
        results = run_cka(runs, runs / "traj", "--runs", runs / "clm", runs / "mlm", "--control", runs / "mlm",
                          runs / "mlm_twin")
    assert said.getvalue().count("divergence by region, pair") == 5  # progress: a line per step, the bar off
    return results


def test_keep_every_steps_survive_max_ckpts_weights_only_and_the_trajectory_places_them(runs, trajectory):
    # 8 was full, then dropped by max_ckpts (not a multiple of 6); 16 and 20 are the newest 2 full ones.
    assert steps_in(runs / "clm") == steps_in(runs / "mlm") == {6: True, 12: True, 16: False, 18: True, 20: False}
    places = [{"step": s, "tokens": s * 8 * 64, "phase": "main" if s <= 16 else "decay"} for s in (6, 12, 16, 18, 20)]
    for place in places:
        ckpt = runs / "clm" / f"ckpt-{place['step']}"
        assert json.loads((ckpt / "progress.json").read_text()) == place
        assert (ckpt / "train_state.pt").exists() == (place["step"] in (16, 20))
    assert [{k: p[k] for k in place} for p in trajectory["steps"]] == places
    last = trajectory["steps"][-1]  # the final checkpoints stand for their own step
    assert last["pair"]["checkpoints"] == [str(runs / "clm" / "final"), str(runs / "mlm" / "final")]
    for p in trajectory["steps"]:
        assert len(p["pair"]["layers"]) == len(p["control"]["layers"]) == 4
        assert len(p["pair"]["regions"]) == len(p["ratio"]) == 3
    table = (runs / "traj" / "trajectory.md").read_text()
    assert table.count("\n| ") == 1 + len(places)  # the header and one row per step
    assert (runs / "traj" / "trajectory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_step_equals_pair_on_the_same_two_checkpoints_exactly(runs, trajectory, tmp_path):
    ckpt = lambda name: str(runs / name / "ckpt-12")  # noqa: E731  (weights-only checkpoints)
    pair = run_cka(runs, tmp_path, "--pair", ckpt("clm"), ckpt("mlm"), "--control", ckpt("mlm"), ckpt("mlm_twin"))
    point = next(p for p in trajectory["steps"] if p["step"] == 12)
    for name in ("pair", "control"):
        for layer, value in enumerate(point[name]["layers"]):
            assert value == pair["layers"][str(layer)][f"{name}_divergence"]  # mean, std, per seed: bit for bit
        for region, value in zip(pair["regions"], point[name]["regions"]):
            assert value == region[f"{name}_divergence"]


def test_trajectory_equals_textbook_cka_on_transformers_forward(runs, trajectory):
    """transformers' ModernBERT (which loads a weights-only step as it is), one text at a time, each layer's
    output mean-pooled, and gram_cka in float64."""
    from transformers import AutoModelForMaskedLM

    texts = (runs / "texts.txt").read_text().split("\n")
    point = next(p for p in trajectory["steps"] if p["step"] == 6)

    def pooled(ckpt):  # (texts, layers, H) float64
        tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
        model = AutoModelForMaskedLM.from_pretrained(ckpt).eval()
        cls, sep = model.config.cls_token_id, model.config.sep_token_id
        outputs = []  # each layer's output (its hidden_states end after the final norm, so hooks instead)
        for layer in model.model.layers:
            layer.register_forward_hook(lambda m, i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        rows = []
        with torch.no_grad():
            for text in texts:
                ids = [cls] + tok.encode(text, add_special_tokens=False).ids[:46] + [sep]
                outputs.clear()
                model(torch.tensor([ids]))
                rows.append([h[0].double().mean(0).numpy() for h in outputs])  # (layers, H)
        return np.array(rows)

    a, b = (pooled(p) for p in point["pair"]["checkpoints"])
    assert a.shape[1] == 4
    for layer in range(4):
        reference = [1 - gram_cka(a[draw, layer], b[draw, layer])
                     for draw in (np.random.default_rng(s).choice(len(texts), 40, replace=False) for s in (1, 2))]
        assert point["pair"]["layers"][layer]["per_seed"] == pytest.approx(reference, abs=1e-5)
