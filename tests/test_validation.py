"""Bad input raises ValueError naming the field and its allowed range; the engine stays usable."""

from __future__ import annotations

import json

import pytest
from support import save_word_tokenizer

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "field", "range_text"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": -5}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", ">= -1"),
        ({"seed": -1}, "seed", "[0, 2**63)"),
        ({"stop": [""]}, "stop", "non-empty"),
    ],
)
def test_bad_sampling_params(kwargs: dict, field: str, range_text: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and range_text in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_bad_engine_config(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_bad_prompts_leave_engine_usable(default_llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    good = default_llm.generate(["Hello"], params)[0].outputs[0].token_ids
    max_len = default_llm.engine.max_model_len
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate([""], params)
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([{"prompt_token_ids": [1] * max_len}], params)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be integers in \[0, 49152\)"):
        default_llm.generate([{"prompt_token_ids": [1, 10**6]}], params)
    # A bad prompt after good ones in the same call: nothing is left queued.
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate(["Hello", ""], params)
    engine = default_llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    assert default_llm.generate(["Hello"], params)[0].outputs[0].token_ids == good


def test_missing_model_folder(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_malformed_model_folders(tmp_path) -> None:
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(str(no_config))
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(bad_json))
    unknown = tmp_path / "unknown_arch"
    unknown.mkdir()
    (unknown / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ValueError, match=r"not supported; supported: .*LlamaForCausalLM"):
        LLM(str(unknown))


def test_folder_without_weights(tmp_path, tiny_model) -> None:
    folder = tmp_path / "no_weights"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model("llama") / "config.json").read_text())
    save_word_tokenizer(folder)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        LLM(str(folder), kv_cache_tokens=256)


def test_unknown_engine_option() -> None:
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(not_an_option=1)
