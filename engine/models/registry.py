"""Model classes keyed by the `architectures` entry of a Hugging Face config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MODELS: dict[str, type] = {}


def register_model(*architectures: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        for arch in architectures:
            _MODELS[arch] = cls
        return cls

    return deco


def model_class(hf_config: Any) -> type:
    _import_models()
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"model: architecture {archs or '(none in config.json)'} is not supported; "
        f"supported: {', '.join(sorted(_MODELS))}"
    )


def _import_models() -> None:
    # Importing the modules runs their @register_model decorators.
    from pdmesh.engine.models import llama, mixtral, qwen3_moe  # noqa: F401
