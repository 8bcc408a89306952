"""
Hugging Face ModernBERT checkpoint directories, read (each value checked) and written as transformers does.

config.json (old style, with global_rope_theta / local_rope_theta / global_attn_every_n_layers, or transformers-5
style, with layer_types and rope_parameters: both read, both written) and model.safetensors (or pytorch_model.bin).
model.py's from_pretrained and save_pretrained call these with the config class, so this file knows no model.
"""

import json
import os
import pickle
from dataclasses import asdict, fields

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from support.files import number, read_json, whole

# Settings transformers' ModernBERT has and this one implements in one way only.
FIXED = {"hidden_activation": "gelu", "norm_bias": False, "attention_bias": False, "mlp_bias": False,
         "decoder_bias": True, "classifier_bias": False, "classifier_activation": "gelu"}
# The sizes, each a whole number from 1 to a ceiling far above any ModernBERT (base: 768 wide, 22 layers, 50k
# tokens, 8192 positions): a mistyped or hostile value is named before anything is divided by it or allocated.
SIZES = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
         "num_attention_heads": 1 << 12, "local_attention": 1 << 20, "global_attn_every_n_layers": 1024,
         "max_position_embeddings": 1 << 20}
POSITIVE = ("global_rope_theta", "local_rope_theta", "norm_eps")
NOT_NEGATIVE = ("initializer_range", "initializer_cutoff_factor")
DROPOUT = ("embedding_dropout", "attention_dropout", "attn_out_dropout", "mlp_dropout", "classifier_dropout")
TOKEN_IDS = ("pad_token_id", "cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id")
PROBLEM_TYPES = (None, "single_label_classification", "multi_label_classification", "regression")  # transformers'


def load_config(cls, path, **overrides):
    """The config dataclass `cls` of the checkpoint's config.json (old or transformers-5 style), `overrides` on top."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError("not a checkpoint directory (no config.json): give a run's final/ or ckpt-STEP/, or "
                                "a Hugging Face ModernBERT directory (config.json and model.safetensors)")
    d = read_json(file)
    if d.get("model_type", "modernbert") != "modernbert":
        raise ValueError(f"config.json has model_type={d['model_type']!r}; this code only reads ModernBERT "
                         "checkpoints (model_type 'modernbert')")
    for key, want in FIXED.items():
        if key in d and d[key] != want:
            raise ValueError(f"config.json has {key}={d[key]!r}; ModernBERT as written here needs {want!r}")
    kw = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)} - {"attn_backend"}}  # a run's choice
    if layer_types := d.get("layer_types"):  # transformers 5: an explicit list; it must be "global every n layers"
        listed = layer_types if isinstance(layer_types, list) else []  # anything else fails the comparison below
        n = next((i for i, t in enumerate(listed[1:], 1) if t == "full_attention"), len(listed))
        if layer_types != ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(listed))]:
            raise ValueError(f"config.json layer_types is not 'global every n layers': {layer_types}")
        kw["global_attn_every_n_layers"] = n
    rope = d.get("rope_parameters") or {}
    for hf_type, ours in [("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")]:
        params = (rope.get(hf_type) if isinstance(rope, dict) else rope) or {}
        if not isinstance(params, dict):
            raise ValueError(f"config.json rope_parameters must be an object of {{'rope_theta': ...}} per layer type, "
                             f"not {rope!r}")
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters[{hf_type!r}] uses rope_type "
                             f"{params['rope_type']!r}; only 'default' RoPE is supported")
        if "rope_theta" in params:
            kw[ours] = params["rope_theta"]
    # Some converted checkpoints carry local_rope_theta -1 (or null): the training code's "same as global".
    if kw.get("local_rope_theta") in (None, -1):
        kw["local_rope_theta"] = kw.get("global_rope_theta", cls.global_rope_theta)
    kw = {k: v for k, v in kw.items() if v is not None or not k.endswith("_token_id")}
    config = cls(**{**kw, **overrides})
    check_config(config)
    return config


def check_config(config, where="config.json", fix="fix the file, or copy the checkpoint again from its source"):
    """Every value of the ModernBertConfig of its type and in its range, heads of an even size (RoPE rotates pairs),
    a model that this machine's memory holds; else a ValueError that names the fields."""
    v = vars(config)
    bad = ([f"{k}={v[k]!r} must be a whole number from 1 to {top:,}" for k, top in SIZES.items()
            if not whole(v[k], 1, top)]
           + [f"{k}={v[k]!r} must be a positive number" for k in POSITIVE if not (number(v[k]) and v[k] > 0)]
           + [f"{k}={v[k]!r} must be a number, 0 or more" for k in NOT_NEGATIVE if not number(v[k], 0)]
           + [f"{k}={v[k]!r} must be a number in [0, 1)" for k in DROPOUT
              if not (number(v[k], 0) and v[k] < 1 or k == "attn_out_dropout" and v[k] is None)]
           + [f"{k}={v[k]!r} must be a whole number" for k in TOKEN_IDS if not whole(v[k])])
    if v["classifier_pooling"] not in ("mean", "cls"):
        bad.append(f"classifier_pooling={v['classifier_pooling']!r} must be 'mean' or 'cls'")
    if v["problem_type"] not in PROBLEM_TYPES:
        bad.append(f"problem_type={v['problem_type']!r} must be one of {', '.join(map(str, PROBLEM_TYPES))}")
    labels = v["id2label"]
    if labels is not None and not (isinstance(labels, dict) and set(labels) == {str(i) for i in range(len(labels))}
                                   and all(isinstance(x, str) for x in labels.values())):
        bad.append(f"id2label must map \"0\", \"1\", ... to label names, not {str(labels)[:60]}")
    if not bad and (config.hidden_size % config.num_attention_heads or config.head_dim % 2):
        bad.append(f"hidden_size={config.hidden_size} must split into num_attention_heads={config.num_attention_heads} "
                   "heads of an even size (RoPE rotates pairs), e.g. hidden_size 768 with 12 heads of 64")
    if bad:
        raise ValueError(f"{where}: {'; '.join(bad)}; {fix}")
    need, memory = model_bytes(config), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        raise ValueError(f"{where}: a model of these sizes (hidden_size={config.hidden_size}, intermediate_size="
                         f"{config.intermediate_size}, num_hidden_layers={config.num_hidden_layers}, vocab_size="
                         f"{config.vocab_size}) needs {need / 2 ** 30:,.0f} GiB in float32, more than this machine's "
                         f"{memory / 2 ** 30:,.0f} GiB of memory; {fix}")


def model_bytes(config):
    """Bytes of a ModernBertForMaskedLM of the config in float32: its weights (the embedding, per layer Wqkv, Wo, Wi
    and the MLP's Wo and two norms, the head, the decoder's bias) and its two RoPE tables (2, positions, head_dim)."""
    H, V = config.hidden_size, config.vocab_size
    layer = 4 * H * H + 3 * H * config.intermediate_size + 2 * H
    weights = V * H + config.num_hidden_layers * layer + H * H + 3 * H + V
    return 4 * (weights + 2 * 2 * config.max_position_embeddings * config.head_dim)


def config_to_hf(config, architecture):
    """config.json that transformers 4.48+ and 5 both read (the old keys and the new)."""
    d = {k: v for k, v in asdict(config).items() if k != "attn_backend" and v is not None}
    if config.id2label:
        d["label2id"] = {label: int(i) for i, label in config.id2label.items()}
    d.update({"architectures": [architecture], "model_type": "modernbert", **FIXED, "tie_word_embeddings": True,
              "sparse_prediction": False,
              "layer_types": ["full_attention" if config.is_global(i) else "sliding_attention"
                              for i in range(config.num_hidden_layers)],
              "rope_parameters": {t: {"rope_type": "default", "rope_theta": theta} for t, theta in
                                  [("full_attention", config.global_rope_theta),
                                   ("sliding_attention", config.local_rope_theta)]}})
    return d


def weights_file(path):
    """The directory's weights file: model.safetensors, else pytorch_model.bin."""
    for file in (os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin")):
        if os.path.isfile(file):
            return file
    raise FileNotFoundError(f"{path}: no model.safetensors (or pytorch_model.bin)")


def load_weights(model, path):
    """Fill `model` (a ModernBertForMaskedLM, or a classifier) from the directory's weights, which may come from
    ModernBertForMaskedLM, a bare ModernBertModel or a classifier. The encoder must be there and of the config's
    shapes; a task head that is not (a classifier on top of an MLM checkpoint) keeps its init, as in transformers."""
    file = weights_file(path)
    try:
        state = (load_file(file) if file.endswith(".safetensors")
                 else torch.load(file, map_location="cpu", weights_only=True))
    except pickle.UnpicklingError:  # weights_only: a pickle that would build anything but tensors
        raise ValueError(f"{file}: refused: it holds objects other than tensors, and loading them would run code; "
                         "take the model from a source you trust, as model.safetensors") from None
    except (SafetensorError, RuntimeError, EOFError, KeyError, ValueError) as e:  # a truncated or malformed file
        raise ValueError(f"cannot load {file} ({type(e).__name__}: {e}): is the file complete? Copy it again") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(t) for k, t in state.items()):
        raise ValueError(f"{file} holds a {type(state).__name__}, not named tensors: it is no model's weights")
    if not any(k.startswith("model.") for k in state):  # a bare ModernBertModel: keys without the prefix
        state = {"model." + k: v for k, v in state.items()}
    expected = {k: v for k, v in model.state_dict().items() if k != "decoder.weight"}  # tied to the embedding
    optional = () if hasattr(model, "decoder") else ("classifier.", "head.")
    missing = sorted(k for k in set(expected) - set(state) if not k.startswith(optional))
    other_heads = ("decoder.", "classifier.", "head.", "drop.")  # heads of other task models
    unexpected = sorted(k for k in set(state) - set(expected) if not k.startswith(other_heads))
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match a {type(model).__name__} of its config.json: "
                         f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                         f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for k in sorted(set(expected) & set(state)):
        if state[k].shape != expected[k].shape or not state[k].is_floating_point():
            raise ValueError(f"{path}: {k} is {str(state[k].dtype)[6:]} of shape {tuple(state[k].shape)} but "
                             f"config.json implies floating point of shape {tuple(expected[k].shape)}")
    model.load_state_dict({k: state[k] for k in set(expected) & set(state)}, strict=False)


def save(model, path):
    """config.json and model.safetensors that transformers loads as they are."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.config, type(model).__name__), f, indent=2)
    # decoder.weight is the embedding matrix: stored once, as transformers does.
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "decoder.weight"}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
