"""Structured output: constraints compiled by xgrammar, a matcher per request, token bitmasks.

Callers may rely on: `Grammars.compile` and `matcher` raise InvalidRequest naming the
`structured_outputs.<kind>` field for a constraint that is longer than MAX_SPEC_CHARS, a regex
or grammar that repeats a part more than MAX_REPETITION times (grammar_check.py), one that
xgrammar cannot compile, whose compilation runs past COMPILE_TIMEOUT_S, or that no output can
ever satisfy (an empty language: nothing the tokenizer can write is allowed at the start; or a
rule that recurses with no way to end); the messages carry no source locations of the grammar
library. They raise Overloaded when MAX_CONCURRENT_COMPILES compilations are running already and
none ends within SLOT_WAIT_S (a caller's thread is never parked long behind slow ones). Each
compilation runs on a thread of its own that leaves the GIL while it works, so neither the
engine thread nor a cheap constraint behind it waits for a slow one; compiled grammars are
cached by constraint (the last CACHE_SIZE).

Each step, `start_masks` fills the bitmasks on a thread of its own while the forward runs and
`mask` leaves only the tokens a request's grammar allows in its row of the logits (after
penalties, before temperature and filters, so no filter can remove every allowed token);
`Request.add_token` advances the matcher. The engine never launches a step ahead of a token a
matcher has not seen (engine/scheduling/overlap.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import torch

from pdmesh.engine.sample.grammar_check import MAX_REPETITION, productive_root, repetition
from pdmesh.errors import InvalidRequest, Overloaded, without_source_locations
from pdmesh.sampling_params import StructuredOutputsParams
from pdmesh.validation import MAX_SPEC_CHARS  # the edge's limit, checked again here

COMPILE_TIMEOUT_S = 10.0
MAX_CONCURRENT_COMPILES = 4
SLOT_WAIT_S = 1.0  # a compile finding every slot taken waits this long, then is refused
CACHE_SIZE = 256
_FIELD = "structured_outputs"


def clean_message(error: BaseException) -> str:
    """An xgrammar error's text without its source locations, on one line."""
    return without_source_locations(str(error)) or type(error).__name__


class Grammars:
    """One engine's compiler (built on first use: xgrammar reads the whole vocabulary)."""

    def __init__(self, folder: Path, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._folder, self._vocab_size, self._stop = folder, vocab_size, list(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache and building the compiler
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT_COMPILES)

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh matcher (xgrammar.GrammarMatcher) for `so`, from the cache when compiled."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))

    def compile(self, so: StructuredOutputsParams) -> Any:
        """`so` compiled and checked (cached). Thread-safe: servers call it off the engine
        thread before admitting a request, so a compilation never holds up the running batch."""
        kind = so.kind
        spec = getattr(so, kind)
        field = f"{_FIELD}.{kind}"
        try:
            text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        except (RecursionError, ValueError, TypeError):
            raise InvalidRequest(f"{field} is nested too deeply or is not JSON.", field) from None
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequest(
                f"{field} is {len(text)} characters long; at most {MAX_SPEC_CHARS} are accepted.",
                field,
            )
        if kind in ("regex", "grammar") and (times := repetition(text)) > MAX_REPETITION:
            raise InvalidRequest(
                f"{field} repeats a part {times:,} times; at most {MAX_REPETITION:,} are accepted "
                "(the compiler unrolls bounded repetition).",
                field,
            )
        key = (kind, text)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = self._compile_bounded(kind, spec, field)
        self._check_satisfiable(compiled, field)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_bounded(self, kind: str, spec: Any, field: str) -> Any:
        """Compile on a thread of its own, at most MAX_CONCURRENT_COMPILES at once. A compilation
        past the time limit cannot be stopped: it runs on and keeps its slot until it ends."""
        compiler = self._get_compiler()
        if not self._slots.acquire(timeout=SLOT_WAIT_S):
            raise Overloaded(
                f"{MAX_CONCURRENT_COMPILES} structured-output constraints are compiling already; "
                "try again shortly."
            )
        result: Future[Any] = Future()

        def run() -> None:
            try:
                result.set_result(_compile(compiler, kind, spec))
            except BaseException as e:  # handed to the waiting caller
                result.set_exception(e)
            finally:
                self._slots.release()

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        try:
            return result.result(timeout=COMPILE_TIMEOUT_S)
        except FutureTimeout:
            raise InvalidRequest(
                f"{field} took more than {COMPILE_TIMEOUT_S:g} s to compile; simplify it.", field
            ) from None
        except (RuntimeError, ValueError, TypeError, OverflowError, RecursionError) as e:
            raise InvalidRequest(f"{field} cannot be enforced: {clean_message(e)}", field) from None

    def _check_satisfiable(self, compiled: Any, field: str) -> None:
        """Refuse a constraint no output can satisfy, before it reaches a batch."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()) and not matcher.is_completed():
            raise InvalidRequest(
                f"{field} allows no output at all: no text this model's tokenizer can write "
                "satisfies it.",
                field,
            )
        if not productive_root(str(compiled.grammar)):
            raise InvalidRequest(
                f"{field} allows no finite output: a rule refers to itself with no way to end "
                "(recursion without a base case).",
                field,
            )

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self._folder)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler


def _compile(compiler: Any, kind: str, spec: Any) -> Any:
    if kind == "json":
        return compiler.compile_json_schema(spec if isinstance(spec, str) else json.dumps(spec))
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":  # one rule: any of the strings, as EBNF literals
        return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, spec)))
    return compiler.compile_grammar(spec)


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
