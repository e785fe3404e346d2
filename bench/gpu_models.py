"""Real model shapes for GPU benchmarks (weights are random: load_format="dummy"), the tiny shape
of dry runs and tests, and the engine they run on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The fields of a decoder's shape in HF configs, in the order `decoder_config` takes them.
SHAPE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
# The shape of dry runs on the CPU and of the tests' tiny models.
TINY = dict(zip(SHAPE, (512, 64, 128, 2, 4, 2), strict=True))


def llama3_rope(theta: float = 500000.0, original_max_positions: int = 8192) -> dict[str, Any]:
    """Llama 3.1's rope scaling (`rope_parameters`), with its base and original context."""
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_max_positions,
    }


def decoder_config(cls: str, shape: tuple[int, ...], **extra: Any) -> Any:
    """An untied decoder's HF config of class `cls`, `shape` giving its SHAPE fields in order."""
    import transformers

    architectures = [cls.replace("Config", "ForCausalLM")]
    shaped = dict(zip(SHAPE, shape, strict=True))
    return getattr(transformers, cls)(
        **shaped, tie_word_embeddings=False, architectures=architectures, **extra
    )


def llama_8b_config() -> Any:
    return decoder_config(
        "LlamaConfig",
        (128256, 4096, 14336, 32, 32, 8),
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters=llama3_rope(),
    )


def qwen3_moe_30b_config() -> Any:
    return decoder_config(
        "Qwen3MoeConfig",
        (151936, 2048, 6144, 48, 32, 4),
        head_dim=128,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )


def write_config(folder: Path, config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder


def random_checkpoint(
    config: Any, folder: Path, std: float, device: str = "cpu", dtype: Any = None
) -> Path:
    """A checkpoint of `config` in `dtype` (default float32) with its matrices drawn from
    N(0, std) after seeding torch with 0 (norm weights keep their ones)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdmesh.bench.report import free_memory

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    free_memory()  # a large model leaves the GPU to the engines that load the checkpoint
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


def dummy_llm(folder: Path, **options: Any) -> Any:
    """The engine on the model folder's shape with random bf16 weights and no tokenizer;
    `options` are EngineConfig fields."""
    from pdmesh import LLM

    defaults = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    return LLM(str(folder), **{**defaults, **options})
