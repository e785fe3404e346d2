"""What serving a model needs to know before any weights are loaded, read from its folder's
config.json and generation_config.json as plain JSON (no transformers, no torch): the router's
view of a model, and the part of the engine's `ModelInfo` the two must agree on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MAX_POSITION = 4096  # a config without max_position_embeddings


@dataclass(frozen=True)
class ModelConfig:
    folder: Path
    architecture: str  # "Llama", "Qwen2", ...: config.json's architecture without "ForCausalLM"
    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...]  # generation_config.json's and config.json's, merged

    @classmethod
    def load(cls, folder: Path) -> ModelConfig:
        """ValueError ("model: ...") when config.json is missing, not JSON or lacks vocab_size."""
        config = read_json(folder / "config.json")
        if config is None:
            raise ValueError(f"model: cannot read {folder / 'config.json'}")
        try:
            generation = read_json(folder / "generation_config.json") or {}
        except ValueError:
            generation = {}  # transformers ignores a broken one too
        vocab_size = config.get("vocab_size")
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"model: {folder / 'config.json'} has no valid vocab_size")
        eos = {*_as_ids(generation.get("eos_token_id")), *_as_ids(config.get("eos_token_id"))}
        architectures = config.get("architectures") or [config.get("model_type", "")]
        return cls(
            folder=folder,
            architecture=str(architectures[0]).removesuffix("ForCausalLM"),
            vocab_size=vocab_size,
            max_position=config.get("max_position_embeddings") or DEFAULT_MAX_POSITION,
            eos_token_ids=tuple(sorted(eos)),
        )


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in `path`; None when there is no such file; ValueError when it is not JSON."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: cannot read {path}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"model: {path} is not a JSON object")
    return value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]
