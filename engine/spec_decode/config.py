"""Speculative decoding's settings: `speculative_config`, named as vLLM names it.

`EngineConfig.speculative_config` holds it as JSON text (the CLI flag `--speculative-config JSON`
and `pdmesh up`'s pass-through to its workers carry it as is); `LLM(speculative_config={...})`
takes a dict. `SpeculativeConfig.parse` turns either into this checked, frozen dataclass; every
bad value is a ValueError naming the field. Torch-free: the CLI's parser reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
# Measured on the 2-core CPU with the default model (BENCHMARKS.md, "Speculative decoding"):
# above this many running sequences a verify step costs more than the tokens it saves.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_FIELD = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Callers may rely on: `num_speculative_tokens` >= 1; for ngram, 1 <= prompt_lookup_min
    <= prompt_lookup_max; for draft_model, `model` set (its vocabulary is checked against the
    target's when the engine loads it); `disable_by_batch_size` >= 1 (None: never stand aside).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None
    # Speculation stands aside for steps with more running sequences than this.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"{_FIELD}.method must be one of {', '.join(METHODS)}, got {self.method!r} "
                "(give `model` for a draft model)."
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{_FIELD}.{name} must be an integer >= 1, got {value!r}.")
        if self.num_speculative_tokens > 32:
            raise ValueError(
                f"{_FIELD}.num_speculative_tokens must be at most 32, got "
                f"{self.num_speculative_tokens}."
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"{_FIELD}.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(
                f"{_FIELD}.disable_by_batch_size must be an integer >= 1 or null, got {b!r}."
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"{_FIELD}.model must name the draft model's folder or .gguf.")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"{_FIELD}.model is for method draft_model, not ngram.")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From JSON text or a dict (vLLM's keys). A `model` without a method means a draft
        model; unknown keys are refused by name."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{_FIELD} is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_FIELD} must be a JSON object, got {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"{_FIELD} has unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}."
            )
        options = dict(value)
        if "model" in options and "method" not in options:
            options["method"] = "draft_model"
        return cls(**options)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, sort_keys=True)
