"""Per-request sampling parameters, validated when built (names follow vLLM). Torch-free: the
router builds them as the engine does."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pdmesh.errors import InvalidRequest

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_CHOICES = 16  # n and best_of: sequences one request may fork into


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON's true is no token id or count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `StructuredOutputsParams`): exactly one of a JSON
    schema (`json`, a dict or its text), any JSON object (`json_object`), a `regex`, one of
    `choice`'s strings, or a `grammar` in EBNF (GBNF). Enforced by xgrammar at every token."""

    KINDS: ClassVar[tuple[str, ...]] = ("json", "json_object", "regex", "choice", "grammar")
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        name = "structured_outputs"
        given = self._given()
        if len(given) != 1:
            raise InvalidRequest(
                f"{name} must set exactly one of json, json_object, regex, choice and grammar; "
                f"got {', '.join(given) or 'none'}.",
                name,
            )
        if not isinstance(self.json, dict | str | type(None)):
            raise InvalidRequest(f"{name}.json must be a JSON schema object.", f"{name}.json")
        for key in ("regex", "grammar"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequest(f"{name}.{key} must be a non-empty string.", f"{name}.{key}")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequest(
                f"{name}.choice must be a list of non-empty strings.", f"{name}.choice"
            )

    def _given(self) -> list[str]:
        # json_object is a flag; the others are set when not None (json={} is any JSON value).
        flag = ["json_object"] if self.json_object else []
        return [k for k in self.KINDS if k != "json_object" and getattr(self, k) is not None] + flag

    @property
    def kind(self) -> str:
        """The one constraint set: json, json_object, regex, choice or grammar."""
        return self._given()[0]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 disable those filters. A request
    stops at `max_tokens` new tokens ("length"), or at EOS, a `stop_token_ids` entry or a `stop`
    string ("stop"); stop strings and stop tokens are not part of the returned text. A bad value
    raises `InvalidRequest` (a ValueError) whose `field` names it.
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
    # Log-probabilities (of the model's raw logits, as vLLM's default): for each sampled token
    # its own and the `logprobs` most likely alternatives; for each prompt token after the
    # first its own and `prompt_logprobs` alternatives. None: off; at most MAX_LOGPROBS.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # As vLLM defines them, applied to the logits before temperature and filters: presence and
    # frequency penalties over the output so far, the repetition penalty over prompt and output
    # (a positive logit divided by it, a negative one multiplied), a bias per token id, and no
    # EOS or stop token before `min_tokens` new tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        # Accept lists (and a bare string for `stop`) the way vLLM does; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.", "max_tokens"
            )
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(
                f"temperature must be a finite number >= 0 (0 is greedy), got {t!r}.",
                "temperature",
            )
        if not is_int(self.top_k) or not -1 <= self.top_k < 2**63:
            raise InvalidRequest(
                f"top_k must be an integer >= -1 (0 or -1: off) and < 2**63, got {self.top_k!r}.",
                "top_k",
            )
        if not _is_number(self.top_p) or not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be a number in (0, 1], got {self.top_p!r}.", "top_p")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequest(
                f"seed must be an integer in [0, 2**63), got {self.seed!r}.", "seed"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(
                    f"stop must be a list of non-empty strings, got {self.stop!r:.200}.", "stop"
                )
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise InvalidRequest(
                    "stop_token_ids must be non-negative integers, "
                    f"got {self.stop_token_ids!r:.200}.",
                    "stop_token_ids",
                )

        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidRequest(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {k!r}.", name
                )

        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise InvalidRequest(f"{name} must be a number in [-2, 2], got {v!r}.", name)
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or not 0 < r <= 10:
            raise InvalidRequest(
                f"repetition_penalty must be a number in (0, 10] (1: off), got {r!r}.",
                "repetition_penalty",
            )
        self._validate_bias()
        self._validate_choices()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise InvalidRequest(
                "structured_outputs must be a StructuredOutputsParams.", "structured_outputs"
            )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}.",
                "min_tokens",
            )

    def _validate_choices(self) -> None:
        if not is_int(self.n) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(
                f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}.", "n"
            )
        b = self.best_of
        if b is not None and (not is_int(b) or not self.n <= b <= MAX_CHOICES):
            raise InvalidRequest(
                f"best_of must be an integer in [n, {MAX_CHOICES}] (n is {self.n}) or null, "
                f"got {b!r}.",
                "best_of",
            )

    def _validate_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > 1024:
            raise InvalidRequest(
                "logit_bias must map at most 1024 token ids to biases.", "logit_bias"
            )
        for token, value in bias.items():
            if not is_int(token) or token < 0:
                raise InvalidRequest(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r:.50}.",
                    "logit_bias",
                )
            if not _is_number(value) or not -100 <= value <= 100:
                raise InvalidRequest(
                    f"logit_bias values must be numbers in [-100, 100], got {value!r:.50}.",
                    "logit_bias",
                )

    @property
    def num_sequences(self) -> int:
        """Sequences generated: best_of, or n when best_of is not set."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_sequences(self) -> bool:
        """Whether the n returned are chosen by cumulative log-probability (best_of > n): each
        sampled token's log-probability is then computed, asked for or not."""
        return self.num_sequences > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def depends_on_output(self) -> bool:
        """Whether a token depends on the output before it by more than context: a seeded
        random stream's position, penalties or min_tokens counting output tokens, a grammar's
        matcher. A request resumed after some output is then continued where that state is
        rebuilt from the output (a decode worker replays it), not prefilled from scratch."""
        seeded = self.seed is not None and not self.greedy
        return seeded or self.shapes_logits or self.structured_outputs is not None

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties, a bias or min_tokens change the logits before sampling."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )
