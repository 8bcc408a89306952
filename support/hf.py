"""
Hugging Face ModernBERT checkpoint directories, read and written as transformers does: config.json (old style,
with global_rope_theta / local_attention / global_attn_every_n_layers, or transformers-5 style, with layer_types
and rope_parameters; both are read, both are written) and model.safetensors (or pytorch_model.bin).

model.py's from_pretrained / save_pretrained call these; the config class is passed in, so this file knows no
model.
"""

import json
import os
import pickle
from dataclasses import asdict, fields

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # the weights file names, in the order they are looked for
# Settings transformers' ModernBERT has and this one implements in one way only.
FIXED = {"hidden_activation": "gelu", "norm_bias": False, "attention_bias": False, "mlp_bias": False,
         "decoder_bias": True, "classifier_bias": False, "classifier_activation": "gelu"}


def config_from_hf(cls, d, **overrides):
    """The config dataclass `cls` from a config.json dict, old style or transformers-5 style."""
    if d.get("model_type", "modernbert") != "modernbert":
        raise ValueError(f"config.json has model_type={d['model_type']!r}; this code only reads ModernBERT "
                         "checkpoints (model_type 'modernbert')")
    for key, want in FIXED.items():
        if key in d and d[key] != want:
            raise ValueError(f"config.json has {key}={d[key]!r}; ModernBERT as written here needs {want!r}")
    kw = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
    layer_types = d.get("layer_types")
    if layer_types:  # transformers 5: an explicit list; it must be "global every n layers"
        n = next((i for i, t in enumerate(layer_types[1:], 1) if t == "full_attention"), len(layer_types))
        if layer_types != ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(layer_types))]:
            raise ValueError(f"config.json layer_types is not 'global every n layers': {layer_types}")
        kw["global_attn_every_n_layers"] = n
    rope = d.get("rope_parameters") or {}
    for hf_type, ours in [("full_attention", "global_rope_theta"), ("sliding_attention", "local_rope_theta")]:
        params = rope.get(hf_type) or {}
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters[{hf_type!r}] uses rope_type "
                             f"{params['rope_type']!r}; only 'default' RoPE is supported")
        if "rope_theta" in params:
            kw[ours] = params["rope_theta"]
    # Some converted checkpoints carry local_rope_theta -1 (or null): the training code's "same as global".
    if kw.get("local_rope_theta") in (None, -1):
        kw["local_rope_theta"] = kw.get("global_rope_theta", cls.global_rope_theta)
    kw = {k: v for k, v in kw.items() if v is not None or not k.endswith("_token_id")}
    return cls(**{**kw, **overrides})


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


def load_config(cls, path, **overrides):
    """`cls` from the checkpoint directory's config.json; `overrides` set fields the file does not decide."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no config.json; a Hugging Face ModernBERT checkpoint directory has "
                                "config.json and model.safetensors")
    with open(file) as f:
        return config_from_hf(cls, json.load(f), **overrides)


def weights_file(path):
    """The directory's weights file: model.safetensors, else pytorch_model.bin."""
    found = [os.path.join(path, name) for name in WEIGHTS if os.path.isfile(os.path.join(path, name))]
    if not found:
        raise FileNotFoundError(f"{path}: no model.safetensors (or pytorch_model.bin)")
    return found[0]


def load_state(path):
    """The state dict of a checkpoint directory; a file cut short is named."""
    file = weights_file(path)
    try:
        return load_file(file) if file.endswith(".safetensors") else torch.load(file, map_location="cpu",
                                                                                  weights_only=True)
    except (SafetensorError, RuntimeError) as e:  # what a truncated file raises, without its name
        raise ValueError(f"cannot load {file} ({e}): is the file complete? Copy it again.") from None
    except pickle.UnpicklingError:  # weights_only: a pickle that would build anything but tensors
        raise ValueError(f"{file}: refused: it holds objects other than tensors, and loading them would run code; "
                         "take the model from a source you trust, as model.safetensors") from None


def load_weights(model, path):
    """Fill `model` (a ModernBertForMaskedLM, or a classifier) from the directory's weights, which may come from
    ModernBertForMaskedLM, a bare ModernBertModel or a classifier. The encoder must be there and of the config's
    shapes; a task head that is not (a classifier on top of an MLM checkpoint) keeps its init, as in transformers."""
    state = load_state(path)
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
        if state[k].shape != expected[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)} but config.json implies "
                             f"{tuple(expected[k].shape)}")
    model.load_state_dict({k: state[k] for k in set(expected) & set(state)}, strict=False)


def save(model, path):
    """config.json and model.safetensors that transformers loads as they are."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(model.config, type(model).__name__), f, indent=2)
    # decoder.weight is the embedding matrix: stored once, as transformers does.
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "decoder.weight"}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
