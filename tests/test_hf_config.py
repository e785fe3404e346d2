"""The engine's own config.json reader against transformers' AutoConfig: every value the model
classes read, on minimal configs (transformers' defaults), explicit ones, the test models' and
the default model's, so that a transformers release that changes a default fails here."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import _tiny_configs
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pdmesh.bench.gpu_models import llama3_rope
from pdmesh.engine.layers.rotary import (
    RotaryEmbedding,
    default_inv_freq,
    llama3_inv_freq,
    rope_parameters,
)
from pdmesh.engine.models import model_class
from pdmesh.engine.models.hf_config import DEFAULTS, read_config
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.models.llama import head_dim_of
from pdmesh.engine.parallel.group import SINGLE
from pdmesh.engine.parallel.pipeline import SINGLE_STAGE

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
# What the model classes and ModelInfo read (models/*.py, layers/rotary.py, models/info.py).
READ = sorted({k for d in DEFAULTS.values() for k in d} - {"rope_theta"}
              | {"num_experts", "num_local_experts", "architectures", "_name_or_path"})  # fmt: skip


def _folder(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _assert_same(folder: Path) -> None:
    ours, theirs = read_config(folder), AutoConfig.from_pretrained(folder)
    assert isinstance(ours, SimpleNamespace), "a plain config must not need transformers"
    for key in READ:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    assert head_dim_of(ours) == head_dim_of(theirs)
    rope = (RotaryEmbedding(c, head_dim_of(c), 64).cos_sin_cache for c in (ours, theirs))
    assert torch.equal(*rope)
    assert model_class(ours) is model_class(theirs)


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_defaults_are_transformers_defaults(tmp_path: Path, model_type: str) -> None:
    arch = ARCHITECTURES[model_type]
    _assert_same(_folder(tmp_path, "bare", {"model_type": model_type, "architectures": [arch]}))
    explicit = {"model_type": model_type, "architectures": [arch], "num_key_value_heads": 2,
                "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1000,
                "rope_theta": 123.0, "num_experts": 6, "num_local_experts": 6,
                "rope_scaling": {"type": "default"}}  # fmt: skip
    _assert_same(_folder(tmp_path, "explicit", explicit))


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling"])
def test_llama_3_1_rope_is_read_without_transformers(tmp_path: Path, form: str) -> None:
    """Llama 3.1's RoPE scaling (8B's values), written as transformers 5 writes it or as the
    released checkpoints do: the same tables as transformers', bit for bit, over 128k positions."""
    rope = llama3_rope()  # rope_type llama3, theta 500000, factor 8, original context 8192
    if form == "rope_scaling":  # {"rope_theta": ..., "rope_scaling": {"type": "llama3", ...}}
        scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
        rope = {"rope_theta": rope["rope_theta"], "rope_scaling": {"type": "llama3", **scaling}}
    else:
        rope = {"rope_parameters": rope}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
              "num_attention_heads": 32, "max_position_embeddings": 131072, **rope}  # fmt: skip
    folder = _folder(tmp_path, "llama31", config)
    _assert_same(folder)
    ours, theirs = read_config(folder), AutoConfig.from_pretrained(folder)
    # The frequencies against transformers' own llama3 function (RotaryEmbedding computes
    # them itself now, whichever config it is given).
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](theirs, torch.device("cpu"))
    params = rope_parameters(ours)
    assert torch.equal(llama3_inv_freq(default_inv_freq(params["rope_theta"], 128), params), want)
    assert scale == 1.0
    tables = (RotaryEmbedding(c, 128, 131072).cos_sin_cache for c in (ours, theirs))
    assert torch.equal(*tables)


def test_the_test_models_and_the_default_model_read_the_same(
    tmp_path: Path, default_model_folder: Path, small_model_folder: Path
) -> None:
    _assert_same(default_model_folder)
    _assert_same(small_model_folder)
    for arch, (model_cls, config) in _tiny_configs().items():  # llama: Llama 3.1's RoPE
        config.architectures = [model_cls.__name__]  # as saving the model writes it
        config.save_pretrained(tmp_path / arch)
        _assert_same(tmp_path / arch)


_MISSED: set[str] = set()


class _Recording(SimpleNamespace):
    """A config that notes every attribute read that it lacks (the reader's getattr default
    then decides, not transformers')."""

    def __getattr__(self, name: str) -> Any:
        _MISSED.add(name)
        raise AttributeError(name)


@pytest.mark.parametrize("model_type", sorted(DEFAULTS))
def test_every_key_the_models_read_is_one_the_reader_gives(tmp_path: Path, model_type: str) -> None:
    """Building the model of a bare config (transformers' defaults throughout; on the meta
    device) reads no key that transformers' config holds and the reader's lacks: a model class
    reading a new key fails here until DEFAULTS has it."""
    bare = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]]}
    folder = _folder(tmp_path, "bare", bare)
    ours, theirs = read_config(folder), AutoConfig.from_pretrained(folder)
    _MISSED.clear()
    with torch.device("meta"):
        model_class(ours)(_Recording(**vars(ours)), 64, SINGLE, SINGLE_STAGE)
    missed = {k for k in _MISSED if not k.startswith("_")}
    assert {k for k in missed if getattr(theirs, k, None) is not None} == set()
    if model_type == "qwen2":  # the recording works: qwen2 has no head_dim, the models ask
        assert "head_dim" in missed


def test_what_only_transformers_models_goes_through_it(tmp_path: Path) -> None:
    linear = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "rope_scaling": {"rope_type": "linear", "factor": 2.0}}  # fmt: skip
    assert not isinstance(read_config(_folder(tmp_path, "linear", linear)), SimpleNamespace)
    gemma = _folder(tmp_path, "gemma", {"model_type": "gemma", "architectures": ["Gemma"]})
    assert not isinstance(read_config(gemma), SimpleNamespace)
    with pytest.raises(ValueError, match="architecture"):
        ModelInfo.load(gemma)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        ModelInfo.load(broken)
