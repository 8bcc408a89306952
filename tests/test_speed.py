"""The parts of model.py that are there for speed and memory, against plain references: RoPE in the
activation dtype against the float32 rotation."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model as model_py
from model import ModernBertForMaskedLM, apply_rope, rope_cos_sin
from test_model import padded_batch, randomize_, small_config


# -----------------------------------------------------------------------------
# RoPE in the activation dtype


def float32_rope_cos_sin(positions, head_dim, theta):
    """Textbook tables, float32, unsigned sin."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def float32_apply_rope(x, cos, sin):
    """The rotation in float32, cast back at the end (the path before this change, and transformers')."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return (xf * cos.view(shape) + torch.cat([-x2, x1], -1) * sin.view(shape)).to(x.dtype)


@pytest.mark.parametrize("name", ["long_seqs", "odd_vocab"])
def test_rope_in_bf16_matches_the_float32_rotation(name, monkeypatch):
    """Whole-model logits under bf16 autocast: RoPE applied in bf16 lands within bf16 tolerance of the
    float32 rotation, and is not further from the float32 model than that rotation is."""
    model = randomize_(ModernBertForMaskedLM(small_config(name))).eval()
    ids, mask = padded_batch(model.config.vocab_size, [300, 33, 5, 1, 64], seed=3)
    keep = mask.bool()
    with torch.no_grad():
        exact = model(ids, mask)[keep]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = model(ids, mask)[keep].float()
            monkeypatch.setattr(model_py, "rope_cos_sin", float32_rope_cos_sin)
            monkeypatch.setattr(model_py, "apply_rope", float32_apply_rope)
            before = model(ids, mask)[keep].float()
    scale = exact.abs().max()
    print(f"{name}: |bf16 rope - f32 rope| max {(ours - before).abs().max() / scale:.2e} x max |logit|; "
          f"mean error vs float32 model {(ours - exact).abs().mean():.2e} (f32 rope {(before - exact).abs().mean():.2e})")
    assert (ours - before).abs().max() <= 0.02 * scale
    assert (ours - exact).abs().mean() <= 1.25 * (before - exact).abs().mean()


def test_rope_makes_no_float32_copy_of_q_and_k():
    """Under autocast the tables come in bf16 and the rotation creates no float32 tensor."""
    positions = torch.arange(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos, sin = rope_cos_sin(positions, 16, 10000.0)
    assert cos.dtype == sin.dtype == torch.bfloat16 and cos.shape == (64, 16)
    x = torch.randn(64, 2, 3, 16, dtype=torch.bfloat16)  # (T, q/k, nh, hd)

    seen = set()

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.add(out.dtype)
            return out

    with Dtypes():
        out = apply_rope(x, cos, sin)
    assert out.dtype == torch.bfloat16 and seen == {torch.bfloat16}
    # and it is the rotation: float32 in, float32 out, the textbook formula
    cos32, sin32 = float32_rope_cos_sin(positions, 16, 10000.0)
    x32 = x.float()
    assert (apply_rope(x32, *rope_cos_sin(positions, 16, 10000.0)) - float32_apply_rope(x32, cos32, sin32)).abs().max() \
        <= 1e-6
