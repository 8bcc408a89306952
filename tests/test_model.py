"""model.py against transformers' ModernBERT and against an independent float64 reference."""

import dataclasses
import json
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file

import eval as eval_script
from model import (ModernBertConfig, ModernBertForMaskedLM, ModernBertForSequenceClassification,
                   ModernBertForTokenClassification, cu_seqlens_of)
from support.hf import config_to_hf
from support.tokenizer import load_tokenizer, train_bpe

transformers = pytest.importorskip("transformers")

# Three small configs: sequences much longer than the window, 7 layers, and a
# vocab that is not a multiple of 64.
CONFIGS = {
    "long_seqs": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                      num_attention_heads=4, local_attention=8),
    "seven_layers": dict(vocab_size=640, hidden_size=48, intermediate_size=80, num_hidden_layers=7,
                         num_attention_heads=3, local_attention=16, global_attn_every_n_layers=2),
    "odd_vocab": dict(vocab_size=1003, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, local_attention=32, global_rope_theta=50000.0, local_rope_theta=500.0),
}
SPECIAL = dict(pad_token_id=0, cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)


def small_config(name, **kw):
    return ModernBertConfig(**{**CONFIGS[name], **SPECIAL, **kw})


def randomize_(model, seed=0):
    """Random weights everywhere, norms and biases included, so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
    return model


def padded_batch(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), S), generator=g)
    mask = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    ids[~mask] = 0
    return ids, mask.long()


def hf_model(path):
    model, info = transformers.AutoModelForMaskedLM.from_pretrained(path, output_loading_info=True,
                                                                    attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# -----------------------------------------------------------------------------
# An independent float64 reference: one sequence at a time, explicit masks, every
# formula spelled out from the paper (no code shared with model.py).


def reference_logits(model, ids, causal=False):
    """ids: (S,) one sequence -> (S, V) float64 logits and the list of L layer outputs."""
    c = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    H, nh = c.hidden_size, c.num_attention_heads
    hd = H // nh
    S = ids.shape[0]

    def norm(x, weight):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + c.norm_eps) * weight

    def gelu(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    def rope(x, theta):  # x: (S, nh, hd); rotate (x_j, x_{j+hd/2}) by pos * theta^(-2j/hd)
        j = torch.arange(hd // 2, dtype=torch.float64)
        angle = torch.arange(S, dtype=torch.float64)[:, None] * theta ** (-2 * j / hd)  # (S, hd/2)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # (S, 1, hd/2)
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    x = norm(w["model.embeddings.tok_embeddings.weight"][ids], w["model.embeddings.norm.weight"])
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        is_global = i % c.global_attn_every_n_layers == 0
        h = x if i == 0 else norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + "attn.Wqkv.weight"].T).view(S, 3, nh, hd).unbind(1)
        theta = c.global_rope_theta if is_global else c.local_rope_theta
        q, k = rope(q, theta), rope(k, theta)
        qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
        allowed = torch.ones(S, S, dtype=torch.bool)
        if causal:
            allowed &= ki <= qi
        if not is_global:
            allowed &= (qi - ki).abs() <= c.local_attention // 2
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        att = torch.einsum("hqk,khd->qhd", probs, v).reshape(S, H)
        x = x + att @ w[p + "attn.Wo.weight"].T
        a, g = (norm(x, w[p + "mlp_norm.weight"]) @ w[p + "mlp.Wi.weight"].T).chunk(2, -1)
        x = x + (gelu(a) * g) @ w[p + "mlp.Wo.weight"].T
        layers.append(x)
    x = norm(x, w["model.final_norm.weight"])
    x = norm(gelu(x @ w["head.dense.weight"].T), w["head.norm.weight"])
    return x @ w["model.embeddings.tok_embeddings.weight"].T + w["decoder.bias"], layers


# -----------------------------------------------------------------------------
# 1. Parity with transformers, both directions


def max_logit_diff(ours, hf, ids, mask):
    with torch.no_grad():
        return (ours(ids, mask) - hf(input_ids=ids, attention_mask=mask).logits)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpoints_cross_to_and_from_transformers(name, tmp_path):
    """Ours saved, loaded by transformers; transformers' saved, loaded by ours: the same logits both ways."""
    c = CONFIGS[name]
    ours = randomize_(ModernBertForMaskedLM(small_config(name))).eval()
    ours.save_pretrained(tmp_path / "ours")
    diff = max_logit_diff(ours, hf_model(tmp_path / "ours"), *padded_batch(c["vocab_size"], [70, 33, 5, 1, 64]))
    print(f"{name}: ours -> transformers max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4

    hf_cfg = transformers.ModernBertConfig(
        **{k: v for k, v in c.items() if k not in ("global_rope_theta", "local_rope_theta")}, **SPECIAL,
        rope_parameters={t: {"rope_type": "default", "rope_theta": c.get(key, default)} for t, key, default in [
            ("full_attention", "global_rope_theta", 160000.0), ("sliding_attention", "local_rope_theta", 10000.0)]},
        classifier_pooling="mean")
    hf = randomize_(transformers.ModernBertForMaskedLM(hf_cfg), seed=1).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = ModernBertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.global_attn_every_n_layers == c.get("global_attn_every_n_layers", 3)
    diff = max_logit_diff(ours, hf, *padded_batch(c["vocab_size"], [3, 90, 17, 40]))
    print(f"{name}: transformers -> ours max |logit diff| = {diff:.2e}")
    assert diff <= 1e-4


def test_old_style_config_and_local_theta_minus_one(tmp_path):
    """Older config.json (global_rope_theta, local_rope_theta=-1, ...) and pytorch_model.bin."""
    ours = randomize_(ModernBertForMaskedLM(small_config("long_seqs", local_rope_theta=160000.0))).eval()
    ours.save_pretrained(tmp_path / "new")
    hf = hf_model(tmp_path / "new")
    old = {k: v for k, v in config_to_hf(ours.config, "ModernBertForMaskedLM").items()
           if k not in ("layer_types", "rope_parameters")}
    old["local_rope_theta"] = -1
    os.makedirs(tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    torch.save(hf.state_dict(), tmp_path / "old" / "pytorch_model.bin")
    loaded = ModernBertForMaskedLM.from_pretrained(tmp_path / "old").eval()
    assert loaded.config.local_rope_theta == 160000.0
    assert loaded.decoder.weight is loaded.model.embeddings.tok_embeddings.weight
    assert max_logit_diff(loaded, hf, *padded_batch(512, [50, 20])) <= 1e-4


# -----------------------------------------------------------------------------
# 2-4. Causal mask (no future seen), no leakage across sequences, against the float64 reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[1, 3, 4, 5, 12, 31], [23, 23, 23]])  # padded; packed (no padding)
def test_sdpa_matches_float64_reference(causal, lengths):
    """A batch of sequences against the reference of each alone (none sees another): length 1, shorter and longer
    than the +-4 window. The padded call's logits; the flat call's every layer output (what cka.py compares) and
    its logits on some rows only (sparse prediction: the head on those rows)."""
    model = randomize_(ModernBertForMaskedLM(small_config("long_seqs"))).eval()
    ids, mask = padded_batch(512, lengths, seed=1)
    tokens, cu, S, rows = ids[mask.bool()], cu_seqlens_of(lengths), max(lengths), torch.arange(0, sum(lengths), 3)
    with torch.no_grad():
        ours = model(ids, mask, causal=causal)[mask.bool()]  # (T, V)
        _, layers = model.model(tokens, cu, S, causal=causal, return_layers=True)
        sparse = model(tokens, causal=causal, cu_seqlens=cu, max_seqlen=S, rows=rows)
    refs = [reference_logits(model, ids[b, :n], causal=causal) for b, n in enumerate(lengths)]
    ref, ref_layers = torch.cat([r[0] for r in refs]), [torch.cat(x) for x in zip(*(r[1] for r in refs))]
    worst = (ours.double() - ref).abs().max().item()
    print(f"causal={causal}: SDPA vs float64 reference max |logit diff| = {worst:.2e}")
    assert worst <= 1e-4 and (sparse.double() - ref[rows]).abs().max() <= 1e-4
    assert len(layers) == 4 and all((x.double() - r).abs().max() <= 1e-4 for x, r in zip(layers, ref_layers))


# -----------------------------------------------------------------------------
# 5. Backward on edge cases; the positions' end


@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [3], [200], [1, 50, 4, 9]])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_finite(lengths, causal):
    model = ModernBertForMaskedLM(small_config("long_seqs", attention_dropout=0.1, mlp_dropout=0.1))
    model.train()
    ids, mask = padded_batch(512, lengths, seed=4)
    logits = model(ids, mask, causal=causal)
    assert torch.isfinite(logits).all()
    logits[mask.bool()].logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_a_sequence_past_the_positions_is_refused():
    """RoPE's tables end at max_position_embeddings: the last position runs, one more is a clear error."""
    model = ModernBertForMaskedLM(small_config("long_seqs", max_position_embeddings=16)).eval()
    ids = torch.randint(3, 512, (2, 17))
    with torch.no_grad():
        assert torch.isfinite(model(ids[:, :16])).all()
        with pytest.raises(ValueError, match="a sequence of 17 tokens is beyond max_position_embeddings=16"):
            model(ids)


# -----------------------------------------------------------------------------
# Clear errors


def test_bad_checkpoints_get_clear_errors(tmp_path):
    """No config.json; weights of other shapes than config.json's (other dtypes, a cut file, a directory without
    weights, another model_type: tests/test_files.py and test_mistakes.py)."""
    model = ModernBertForMaskedLM(small_config("long_seqs"))
    model.save_pretrained(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match=r"not a checkpoint directory \(no config.json\)"):
        ModernBertForMaskedLM.from_pretrained(tmp_path / "nothing")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    os.makedirs(tmp_path / "shape")
    (tmp_path / "shape" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    os.link(tmp_path / "ok" / "model.safetensors", tmp_path / "shape" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.Wi\.weight is float32 of shape \(192, 64\) but "
                                         r"config\.json implies floating point of shape \(200, 64\)"):
        ModernBertForMaskedLM.from_pretrained(tmp_path / "shape")


# -----------------------------------------------------------------------------
# 7. Against an outside expectation: what only a full-size model or a foreign checkpoint exercises


def test_presets_are_the_released_configs():
    """Base and Large as answerdotai/ModernBERT-base and -large's config.json give them (PAPER.md, section 3):
    Base 22 x 768, 12 heads, GeGLU branch 1152; Large 28 x 1024, 16 heads, branch 2624; both heads of 64, a
    global layer every 3, local window 128, RoPE theta 160,000 (global) and 10,000 (local), vocab 50,368. The
    parameter count cannot tell the number of heads: only these numbers can."""
    shared = dict(vocab_size=50368, head_dim=64, global_attn_every_n_layers=3, local_attention=128,
                  global_rope_theta=160000.0, local_rope_theta=10000.0, max_position_embeddings=8192, norm_eps=1e-5)
    for preset, sizes in [(ModernBertConfig(), dict(num_hidden_layers=22, hidden_size=768, num_attention_heads=12,
                                                    intermediate_size=1152)),
                          (ModernBertConfig.large(), dict(num_hidden_layers=28, hidden_size=1024,
                                                          num_attention_heads=16, intermediate_size=2624))]:
        assert {k: getattr(preset, k) for k in {**shared, **sizes}} == {**shared, **sizes}
        with torch.device("meta"):  # the parameter count as transformers' for the same sizes
            ours = ModernBertForMaskedLM(preset)
            hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{
                k: getattr(preset, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads")}))
        assert ours.decoder.weight is ours.model.embeddings.tok_embeddings.weight  # tied, counted once
        assert ours.num_params() == sum(p.numel() for p in hf.parameters())
        assert round(ours.num_params() / 1e6, 2) == (149.66 if sizes["num_hidden_layers"] == 22 else 395.88)
    layer_types = transformers.ModernBertConfig().layer_types  # transformers' defaults are ModernBERT-base's
    assert [ModernBertConfig().is_global(i) for i in range(22)] == [t == "full_attention" for t in layer_types]


def test_init_follows_modernbert_at_22_layers():
    """ModernBERT's init (PAPER.md, section 3, as transformers' _init_weights writes it), at the paper's 22 layers
    where the output projections' std 0.02 / sqrt(2 x 22) differs most from the inputs' 0.02: a normal truncated
    at 2 std, whose std is 0.8796 of the untruncated one; norms at 1, decoder bias at 0; a classifier at
    hidden_size ** -0.5 with a zero bias."""
    L, H = 22, 64
    config = ModernBertConfig(vocab_size=512, hidden_size=H, intermediate_size=96, num_hidden_layers=L,
                              num_attention_heads=4, **SPECIAL)
    shrink = math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(math.sqrt(2)))  # 0.8796
    out = 0.02 / math.sqrt(2 * L)
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(config)
    groups = {"tok_embeddings.weight": 0.02, "attn.Wqkv.weight": 0.02, "mlp.Wi.weight": 0.02,
              "attn.Wo.weight": out, "mlp.Wo.weight": out, "head.dense.weight": out}
    params = dict(model.named_parameters())
    for suffix, std in groups.items():
        w = torch.cat([p.detach().flatten() for n, p in params.items() if n.endswith(suffix)]).double()
        assert w.abs().max() <= 2 * std * (1 + 1e-6), f"{suffix}: not truncated at 2 std"
        assert w.std().item() == pytest.approx(shrink * std, rel=0.03), suffix
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in params.items() if "norm" in n)
    assert not params["decoder.bias"].any()
    clf = dict(ModernBertForSequenceClassification(dataclasses.replace(config, id2label={"0": "a", "1": "b"}))
               .named_parameters())
    assert clf["classifier.weight"].std().item() == pytest.approx(shrink * H ** -0.5, rel=0.2)  # 128 values
    assert clf["classifier.weight"].abs().max() <= 2 * H ** -0.5 and not clf["classifier.bias"].any()


def test_bare_encoder_checkpoint_from_transformers_loads_into_classifiers(tmp_path):
    """transformers' ModernBertModel saves its keys without the "model." prefix: a classifier loads it, each
    encoder weight (under "model.", the Hugging Face layout) equal to the file's."""
    c = CONFIGS["seven_layers"]
    hf_cfg = transformers.ModernBertConfig(
        **{k: v for k, v in c.items() if k != "global_attn_every_n_layers"}, **SPECIAL,
        layer_types=["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(7)])
    encoder = randomize_(transformers.ModernBertModel(hf_cfg)).eval()
    encoder.save_pretrained(tmp_path)
    file = load_file(tmp_path / "model.safetensors")
    assert file and not any(k.startswith("model.") for k in file)  # bare: the branch under test
    for cls in (ModernBertForSequenceClassification, ModernBertForTokenClassification):
        ours = cls.from_pretrained(tmp_path, id2label={"0": "a", "1": "b", "2": "c"})
        encoder_weights = {k[len("model."):]: v for k, v in ours.state_dict().items() if k.startswith("model.")}
        assert set(encoder_weights) == set(file), cls.__name__
        assert all(torch.equal(encoder_weights[k], file[k]) for k in file), cls.__name__


# ---------------------------------------------------------------------------------------------------------------------
# Fine-tuning at the model's full context: a long-document task whose label only the end of each document
# tells. At the model's max_position_embeddings (the default) the suite learns it; at max_len 512, the old
# default, it cannot do better than chance.


FILLER = "red green blue cyan magenta yellow black white grey pink".split()
KEYWORD = {"up": "alpha", "down": "omega"}  # the label's word, which appears only after the first 520 tokens


def long_documents(path, tok):
    """640-720 tokens each: 520-560 filler words, then filler with the label's keyword as one word in 5.
    Every word is one token (checked), so the keyword's first position is the word count before it."""
    rng = random.Random(0)
    os.makedirs(path, exist_ok=True)
    for split, n in (("train", 64), ("validation", 24), ("test", 24)):
        with open(os.path.join(path, f"{split}.jsonl"), "w") as f:
            for k in range(n):
                label = ("up", "down")[k % 2]
                head, length = rng.randint(520, 560), rng.randint(640, 720)
                words = [rng.choice(FILLER) for _ in range(head)]
                words += [KEYWORD[label] if rng.random() < 0.2 else rng.choice(FILLER) for _ in range(length - head)]
                words[head] = KEYWORD[label]
                text = " ".join(words)
                ids, start = tok.encode_batch([text, " ".join(words[:head])])
                assert len(ids) == length and start == ids[:head]
                f.write(json.dumps({"text": text, "label": label}) + "\n")


def test_full_context_learns_what_512_tokens_cannot(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    words, rng = FILLER + list(KEYWORD.values()), random.Random(1)
    train_bpe(iter([" ".join(rng.sample(words, len(words))) for _ in range(200)]), 500, str(model / "tokenizer.json"))
    torch.manual_seed(0)
    ModernBertForMaskedLM(ModernBertConfig(vocab_size=500, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=2, local_attention=64, max_position_embeddings=1024,
                                           pad_token_id=0, cls_token_id=2, sep_token_id=3)).save_pretrained(model)
    long_documents(tmp_path / "long", load_tokenizer(str(model)))
    (tmp_path / "suite.py").write_text(
        "seeds = [1]\n"
        "tasks = [dict(name='full', task='cls', data='long', epochs=4, batch_size=8, lr=3e-3),\n"
        "         dict(name='first512', task='cls', data='long', epochs=4, batch_size=8, lr=3e-3, max_len=512)]\n")
    eval_script.main(["--suite", str(tmp_path / "suite.py"), "--models", str(model), "--out", str(tmp_path / "out"),
                      "--device", "cpu"])
    tasks = json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]
    full, first = (next(iter(tasks[t]["models"].values())) for t in ("full", "first512"))  # the one model
    assert full["ran_with"] == {"max_len": 1024, "max_tokens": 4096}  # the model's context, CPU's budget
    assert first["ran_with"] == {"max_len": 512, "max_tokens": 4096}
    f1_full, f1_first = full["macro_f1"]["mean"], first["macro_f1"]["mean"]
    print(f"long documents, test macro F1: full context {f1_full:.3f}, first 512 tokens {f1_first:.3f}")
    assert f1_full > 0.9  # the keyword, seen
    assert f1_first < 0.7  # 512 tokens hold filler only: chance (one class for all: 0.333; a coin: ~0.5)
