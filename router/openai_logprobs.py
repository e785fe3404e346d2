"""Log-probabilities in OpenAI's shapes, built from the wire's `PositionLogprobs` (the chosen
token first, then the top alternatives, each with its rank).

Chat: `choice.logprobs.content`, one entry per token with its text, logprob, UTF-8 bytes and
the `top_logprobs` asked for (the k of rank 1..k). Completions: `choice.logprobs` as four
parallel arrays, `tokens`, `token_logprobs`, `top_logprobs` (the chosen token and the top k, as
vLLM sends them) and `text_offset`; with `echo` the prompt's tokens come first, the first of
them without a logprob (nothing predicts it). A token's text is its own decode; -inf is sent as
-9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pdmesh.v1.generation_pb2 import PositionLogprobs

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """Each token id's own text (cached: a stream repeats the same few thousand tokens)."""

    def __init__(self, decode: Callable[[list[int]], str], max_size: int = 65536) -> None:
        self._decode = decode
        self._cache: dict[int, str] = {}
        self._max_size = max_size

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode([token_id])
            if len(self._cache) < self._max_size:
                self._cache[token_id] = text
        return text


def _ranked(position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    """The top k alternatives (rank 1..k), best first."""
    entries = zip(position.ranks, position.token_ids, position.logprobs, strict=True)
    return [(t, lp) for r, t, lp in sorted(entries) if 1 <= r <= k]


def chat_content(
    positions: Sequence[PositionLogprobs], top_logprobs: int, text: TokenTexts
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for these tokens."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode())}

    out = []
    for p in positions:
        top = [entry(t, lp) for t, lp in _ranked(p, top_logprobs)]
        out.append({**entry(p.token_ids[0], p.logprobs[0]), "top_logprobs": top})
    return out


class CompletionLogprobs:
    """One choice's completions `logprobs` arrays, chunk by chunk: `text_offset` runs on from
    the last chunk's (the offsets are into the choice's whole text, the echoed prompt first)."""

    def __init__(self, top_logprobs: int, text: TokenTexts) -> None:
        self.k = top_logprobs
        self.text = text
        self.offset = 0

    def _arrays(
        self, tokens: Sequence[int], positions: Sequence[PositionLogprobs | None]
    ) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, p in zip(tokens, positions, strict=True):
            s = self.text(token_id)
            out["tokens"].append(s)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
            if p is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(p.logprobs[0]))
            chosen = [(p.token_ids[0], p.logprobs[0])]
            top = {self.text(t): _finite(lp) for t, lp in chosen + _ranked(p, self.k)}
            out["top_logprobs"].append(top)
        return out

    def prompt(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs]
    ) -> dict[str, list[Any]]:
        """The echoed prompt's arrays: `positions` has an entry per token after the first."""
        return self._arrays(token_ids, [None, *positions])

    def tokens(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs]
    ) -> dict[str, list[Any]]:
        return self._arrays(token_ids, positions)


def join_arrays(parts: Sequence[dict[str, list[Any]]]) -> dict[str, list[Any]]:
    """Several chunks' arrays as one (a non-streamed choice)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for part in parts for x in part[k]] for k in keys}
