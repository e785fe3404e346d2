"""Structured output: constraints compiled by xgrammar, a matcher per request, token bitmasks.

Callers may rely on: `Grammars.compile` and `matcher` raise InvalidRequest naming the
`structured_outputs` field for a constraint xgrammar cannot compile, or whose compilation runs
past COMPILE_TIMEOUT_S (the engine stays healthy); compiled grammars are cached by constraint. Each
step, `start_masks` fills the bitmasks on a thread of its own while the forward runs and `mask`
leaves only the tokens a request's grammar allows in its row of the logits (after penalties,
before temperature and filters); `Request.add_token` advances the matcher. The
engine never launches a step ahead of a token a matcher has not seen (engine/scheduling/overlap.py).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from pdmesh.errors import InvalidRequest
from pdmesh.sampling_params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0
_FIELD = "structured_outputs"


class Grammars:
    """One engine's compiler (built on first use: xgrammar reads the whole vocabulary)."""

    def __init__(self, folder: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._folder, self._vocab_size, self._stop = folder, vocab_size, list(stop_token_ids)
        self._compiler: Any = None
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher (xgrammar.GrammarMatcher) for `so`, from the cache when compiled."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))

    def compile(self, so: StructuredOutputsParams) -> Any:
        """`so` compiled (cached). Thread-safe: servers call it off the engine thread before
        admitting a request, so a compilation never holds up the running batch."""
        kind = so.kind
        spec = getattr(so, kind)
        key = (kind, json.dumps(spec, sort_keys=True) if not isinstance(spec, str) else spec)
        with self._lock:
            compiled = self._cache.get(key)
        if compiled is None:
            future = self._pool.submit(self._compile, kind, spec)
            try:
                compiled = future.result(timeout=COMPILE_TIMEOUT_S)
            except FutureTimeout:
                raise InvalidRequest(
                    f"{_FIELD}.{kind} took more than {COMPILE_TIMEOUT_S:g} s to compile; "
                    "simplify it.",
                    f"{_FIELD}.{kind}",
                ) from None
            except (RuntimeError, ValueError, TypeError) as e:
                raise InvalidRequest(
                    f"{_FIELD}.{kind} cannot be enforced: {e}", f"{_FIELD}.{kind}"
                ) from None
            with self._lock:
                self._cache[key] = compiled
        return compiled

    def _compile(self, kind: str, spec: Any) -> Any:
        compiler = self._get_compiler()
        if kind == "json":
            return compiler.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":  # one rule: any of the strings, as EBNF literals
            return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, spec)))
        return compiler.compile_grammar(spec)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._folder)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop
            )
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def constrained(seqs: Sequence[Any]) -> bool:
    return any(s.grammar is not None for s in seqs)


# Bitmasks are filled here while the step's forward runs on the caller's thread (torch leaves
# the GIL while it computes): by the time the logits exist, the masks mostly do too.
_FILLER = ThreadPoolExecutor(1, thread_name_prefix="pdmesh-bitmask")


def start_masks(seqs: Sequence[Any], vocab_size: int) -> Future[torch.Tensor] | None:
    """Begin filling the token bitmask of `seqs` (a row each, every token allowed where a
    sequence has no grammar) for the step about to run; None when none is constrained. The
    matchers must have seen every token so far and must not advance until `mask` returns."""
    if not constrained(seqs):
        return None
    return _FILLER.submit(_fill, [s.grammar for s in seqs], vocab_size)


def _fill(grammars: list[Any], vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_next_token_bitmask(bitmask, row)
    return bitmask


def mask(logits: torch.Tensor, masks: Future[torch.Tensor]) -> torch.Tensor:
    """logits [S, V] float32 -> the same with each constrained row's disallowed tokens -inf,
    by the bitmask `start_masks` began."""
    import xgrammar as xgr

    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, masks.result().to(out.device))
    return out
