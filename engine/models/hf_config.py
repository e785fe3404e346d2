"""A model folder's config.json as the object our model classes read, without transformers for
the architectures whose defaults are written here.

Importing transformers and running `AutoConfig` cost a worker or a TP rank about 4 s of its 7 s
start on 2 cores (the config classes import most of transformers and torch.distributed's
DTensor). For a config.json whose `model_type` is in `DEFAULTS` and that uses nothing this reader
does not model, `read_config` builds the config itself: the file's keys over transformers'
defaults for that type, the same derived values (KV heads, RoPE parameters, expert-count
aliases). Anything else goes through `AutoConfig`, as does RoPE scaling other than Llama 3.1's.
`tests/test_hf_config.py` checks every default and derived value here against transformers' own
classes, so a transformers release that changes one fails a test instead of loading a different
model.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pdmesh.checkpoint.config import read_json
from pdmesh.engine.layers.rotary import LLAMA3_KEYS

# transformers' defaults, by model_type, for the keys the model classes read (models/*.py,
# layers/rotary.py). A key absent here is absent from transformers' config too (head_dim of
# qwen2 and qwen3_moe: the models then use hidden_size // num_attention_heads).
_COMMON = dict(tie_word_embeddings=False, num_key_value_heads=None, rope_theta=10000.0)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, head_dim=None,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, attention_bias=False,
                  mlp_bias=False),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=32768,
                  rms_norm_eps=1e-6),
    "qwen3": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, head_dim=128,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=False),
    "mixtral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=None, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=False,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
}  # fmt: skip
# The attribute transformers keeps an expert count under, and its alias (attribute_map).
_EXPERT_ALIASES = {"mixtral": ("num_local_experts", "num_experts"),
                   "qwen3_moe": ("num_experts", "num_local_experts")}  # fmt: skip
# Keys whose meaning this reader does not model: such a config goes through transformers.
_TRANSFORMERS_ONLY = ("quantization_config", "partial_rotary_factor")


def read_config(folder: Path) -> Any:
    """The config our model classes read: a namespace for a plain config of a known type, else
    transformers' `AutoConfig`. ValueError ("model: ...") when config.json cannot be read."""
    raw = read_json(folder / "config.json")
    if raw is None:
        raise ValueError(f"model: cannot read {folder / 'config.json'}: no such file")
    config = own_config(raw, folder)
    return config if config is not None else _auto_config(folder)


def own_config(raw: dict[str, Any], folder: Path) -> SimpleNamespace | None:
    """`raw` over its type's defaults, with transformers' derived values; None when the type is
    not in DEFAULTS or the config uses what only transformers models (see _TRANSFORMERS_ONLY)."""
    model_type = raw.get("model_type")
    if model_type not in DEFAULTS or any(k in raw for k in _TRANSFORMERS_ONLY):
        return None
    # transformers 5 writes rope_parameters; older files rope_scaling and rope_theta.
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    extra = {"default": (), "llama3": LLAMA3_KEYS}.get(rope_type)
    if extra is None or rope.keys() - {"rope_theta"} != set(extra):
        return None  # linear, yarn, ...: transformers' RoPE helpers need its config object
    values = {**DEFAULTS[model_type], **raw, "_name_or_path": str(folder)}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type == "llama" and values["head_dim"] is None:  # LlamaConfig fills it in
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    theta = float(rope.get("rope_theta", values.pop("rope_theta")))  # the file's or the default
    scaling = {k: rope[k] for k in extra}  # llama3's factors (layers/rotary.py)
    values["rope_parameters"] = values["rope_scaling"] = {
        "rope_theta": theta,
        "rope_type": rope_type,
        **scaling,
    }
    if model_type in _EXPERT_ALIASES:
        stored, alias = _EXPERT_ALIASES[model_type]
        values[stored] = values[alias] = raw.get(stored, raw.get(alias, values[stored]))
    return SimpleNamespace(**values)


def _auto_config(folder: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:  # transformers raises several types for a broken config
        raise ValueError(f"model: cannot read {folder / 'config.json'}: {e}") from None
