"""Real model shapes for GPU benchmarks (weights are random: load_format="dummy")."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def llama_8b_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    )


def qwen3_moe_30b_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def write_config(folder: Path, config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose words are 't0' .. 't{vocab-1}': a stand-in for a model whose
    real tokenizer is not on this machine (random weights make no sense of text anyway)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def write_llama_8b(folder: Path) -> Path:
    """The Llama-3.1-8B shape as a model folder without weights (load_format="dummy")."""
    config = llama_8b_config()
    write_config(folder, config)
    save_word_tokenizer(folder, config.vocab_size)
    return folder
