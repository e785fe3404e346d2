"""Engine configuration: one frozen dataclass, checked when built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _check_positive(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one worker). Names follow vLLM.

    model: a Hugging Face folder, a .gguf file, or None for the embedded default model.
    kv_cache_tokens: KV cache size in tokens; otherwise `kv_cache_memory_fraction` of the device's
    memory (GPU: total; CPU: available RAM), default 0.9 on GPU and 0.1 on CPU.
    max_num_batched_tokens: the per-step token budget (prefill chunks + decodes).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    block_size: int = 16
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_expert_parallel: bool = False
    seed: int = 0
    # "auto": the checkpoint's weights; "dummy": random weights of the model's shapes (speed).
    load_format: str = "auto"
    # No tokenizer: prompts must be token ids and outputs carry no text.
    skip_tokenizer_init: bool = False
    # Never capture CUDA graphs (GPU decode steps run eagerly).
    enforce_eager: bool = False
    # Launch the next decode step before reading the current one's tokens (engine/overlap.py).
    # None: on where decode steps replay CUDA graphs, off elsewhere (the CPU gains nothing).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                f"model must be a path or None (the default model), got {self.model!r}."
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be auto or one of {', '.join(_DTYPES)}, got {self.dtype!r}."
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive("block_size", self.block_size)
        _check_positive("kv_cache_tokens", self.kv_cache_tokens, allow_none=True)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_model_len", self.max_model_len, allow_none=True)
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not (isinstance(fraction, int | float) and 0 < fraction <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}.")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}."
            )
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024 tokens, got {self.block_size}.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
