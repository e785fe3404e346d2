"""A request as the engine loop serves it: its sequence, its detokenizer and the text handed out;
what each sampled token does to it (stop rules), and its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from pdmesh.engine.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    StepDelta,
)
from pdmesh.engine.sampler import Sampler
from pdmesh.engine.sequence import Sequence
from pdmesh.text.detokenizer import IncrementalDetokenizer


@dataclass
class Request:
    """One record per request: the engine's only per-request state besides the scheduler's."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""  # output text handed out so far (held-back text excluded)
    tokenizer: Any = None  # decodes the tokens of log-probabilities
    # Per output token when the request asks for log-probabilities (params.logprobs).
    logprobs: list[PositionLogprobs] | None = None
    # Per prompt token (None for the first) when asked for (params.prompt_logprobs).
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @classmethod
    def start(cls, seq: Sequence, tokenizer: Any, vocab_size: int) -> Request:
        """The record of a new `seq`. A resumed request's output so far (see Sequence) is replayed
        as the lost worker produced it: the detokenizer ends up holding back exactly what that
        worker held back (its text was sent already), and the seed has made its draws."""
        params = seq.params
        detok = IncrementalDetokenizer(
            tokenizer, seq.prompt_token_ids, params.skip_special_tokens, params.stop
        )
        text = "".join(detok.add(t).text for t in seq.output_token_ids)
        for t in seq.output_token_ids if seq.grammar is not None else ():
            seq.grammar.accept_token(t)  # a resumed request's matcher where the lost one was
        if seq.generator is not None and not params.greedy:
            for _ in range(seq.num_output_tokens):  # each streamed token was one draw of the seed
                Sampler.skip_draw(seq.generator, vocab_size)
        logprobs = [] if params.logprobs is not None else None
        prompt = [None] * seq.num_prompt_tokens if params.prompt_logprobs is not None else None
        return cls(seq, detok, text, tokenizer, logprobs, prompt)

    def add_token(
        self,
        token: int,
        eos_token_ids: Container[int],
        max_model_len: int,
        logprobs: PositionLogprobs | None = None,
    ) -> StepDelta:
        """Append a sampled token (and its log-probabilities, when asked for); the delta has the
        text it releases and, when the token is the request's last, why ("stop" or "length":
        the caller then finishes the sequence)."""
        seq, params, detok = self.seq, self.seq.params, self.detokenizer
        seq.append_token(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        # A grammar ends where its matcher accepts a stop token (it allows one once complete).
        ended = seq.grammar is not None and _accept(seq.grammar, token)
        if (
            ended
            or (not params.ignore_eos and token in eos_token_ids)
            or token in params.stop_token_ids
        ):
            # The stop token's own text is not output; text held back for stop strings is.
            text, reason = detok.flush(), "stop"
        else:
            delta = detok.add(token)
            text, reason = delta.text, "stop" if delta.stopped else None
            if reason is None and (
                seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len
            ):
                text, reason = text + detok.flush(), "length"
        self.text += text
        # The wire carries raw entries (no decoded text); prompt ones ride on the first token.
        position = [logprobs] if self.logprobs is not None and logprobs is not None else None
        prompt = self.prompt_logprobs if seq.num_output_tokens == 1 else None
        return StepDelta(seq.request_id, [token], text, reason, position, prompt)

    def output(self) -> RequestOutput:
        seq = self.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[self._completion()],
            finished=seq.is_finished,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=None
            if self.prompt_logprobs is None
            else [p if p is None else self._decoded(p) for p in self.prompt_logprobs],
            metrics=RequestMetrics(
                seq.arrival_time, seq.first_token_time, seq.finished_time, seq.num_preemptions
            ),
        )

    def _completion(self) -> CompletionOutput:
        seq = self.seq
        out = CompletionOutput(0, self.text, seq.output_token_ids, seq.finish_reason)
        if self.logprobs is not None:
            out.logprobs = [self._decoded(p) for p in self.logprobs]
            tokens = seq.output_token_ids
            out.cumulative_logprob = sum(
                p[t].logprob for p, t in zip(self.logprobs, tokens, strict=False)
            )
        return out

    def _decoded(self, position: PositionLogprobs) -> PositionLogprobs:
        """`position` with each token's text (as vLLM's `decoded_token`), when there is a
        tokenizer."""
        if self.tokenizer is None:
            return position
        return {
            t: dataclasses.replace(lp, decoded_token=self.tokenizer.decode([t]))
            for t, lp in position.items()
        }


def _accept(matcher: Any, token: int) -> bool:
    """Advance a structured-output matcher; whether its grammar has ended."""
    if not matcher.accept_token(token):
        # The mask allowed only what the grammar accepts: a refusal is a bug, not bad input.
        raise RuntimeError(f"the structured-output matcher refused token {token}")
    return bool(matcher.is_terminated())
