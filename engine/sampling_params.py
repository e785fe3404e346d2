"""Per-request sampling parameters, validated when built (names follow vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters. A request
    stops at `max_tokens` new tokens ("length"), or at EOS, a `stop_token_ids` entry or a `stop`
    string ("stop"); stop strings and stop tokens are not part of the returned text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists (and a bare string for `stop`) the way vLLM does; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.temperature, int | float) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}."
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1: off), got {self.top_k!r}.")
        if (
            not isinstance(self.top_p, int | float)
            or not math.isfinite(self.top_p)
            or not 0 < self.top_p <= 1
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}.")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}."
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0
