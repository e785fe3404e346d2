"""A request as the engine loop serves it: its choices (a sequence each, with its detokenizer and
the text handed out), what each sampled token does to a choice (stop rules), and its result."""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from pdmesh.engine.outputs import (
    NO_ALLOWED_TOKEN,
    CompletionOutput,
    PositionLogprobs,
    RequestError,
    RequestMetrics,
    RequestOutput,
    StepDelta,
)
from pdmesh.engine.sample.sampler import Sampler
from pdmesh.engine.sequence import Sequence
from pdmesh.text.detokenizer import IncrementalDetokenizer


class RequestFailed(Exception):
    """A failure that belongs to one request (its constraints, its detokenizer, its grammar
    matcher): the engine ends that request with `error` and runs the rest of the batch on."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class Choice:
    """One sequence of a request (one per choice with n > 1, per candidate with best_of)."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""  # output text handed out so far (held-back text excluded)
    # Per output token when the request asks for log-probabilities (params.logprobs).
    logprobs: list[PositionLogprobs] | None = None
    # Sum of the sampled tokens' log-probabilities, where computed (logprobs or best_of > n).
    cumulative_logprob: float = 0.0


@dataclass
class Request:
    """One record per request: the engine's only per-request state besides the scheduler's."""

    choices: list[Choice]
    tokenizer: Any = None  # decodes the tokens of log-probabilities
    # Per prompt token (None for the first) when asked for (params.prompt_logprobs).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: RequestError | None = None  # why the engine ended it early (finish_reason "error")

    @classmethod
    def start(cls, seqs: list[Sequence], tokenizer: Any) -> Request:
        """The record of new sequences, one per choice (the first runs the prompt). A resumed
        request's output so far (see Sequence; one choice only) is replayed as the lost worker
        produced it: the detokenizer ends up holding back exactly what that worker held back
        (its text was sent already), and the seed has made its draws."""
        choices = []
        for seq in seqs:
            params = seq.params
            detok = IncrementalDetokenizer(
                tokenizer, seq.prompt_token_ids, params.skip_special_tokens, params.stop
            )
            text = "".join(detok.add(t).text for t in seq.output_token_ids)
            for t in seq.output_token_ids if seq.grammar is not None else ():
                seq.grammar.accept_token(t)  # a resumed request's matcher where the lost one was
            if seq.generator is not None and not params.greedy:
                for _ in range(seq.num_output_tokens):  # each token sent was one draw
                    Sampler.skip_draw(seq.generator)
            logprobs = [] if params.logprobs is not None else None
            choices.append(Choice(seq, detok, text, logprobs))
        first = seqs[0]
        asks = first.params.prompt_logprobs is not None
        prompt = [None] * first.num_prompt_tokens if asks else None
        return cls(choices, tokenizer, prompt)

    @property
    def seq(self) -> Sequence:
        """The first choice's sequence: the one that runs the prompt."""
        return self.choices[0].seq

    @property
    def is_finished(self) -> bool:
        """Every choice has ended."""
        return all(c.seq.is_finished for c in self.choices)

    def add_token(
        self,
        seq: Sequence,
        token: int,
        eos_token_ids: Container[int],
        max_model_len: int,
        logprobs: PositionLogprobs | None = None,
    ) -> StepDelta:
        """Append a token sampled for choice `seq` (and its log-probabilities, when computed);
        the delta has the text it releases and, when the token is the choice's last, why
        ("stop" or "length": the caller then finishes the sequence). Raises RequestFailed for a
        row the runner could not sample and for a failure of this request's own detokenizer or
        grammar matcher."""
        if token < 0:
            raise RequestFailed(_unsampled(seq, token))
        try:
            return self._add_token(seq, token, eos_token_ids, max_model_len, logprobs)
        except RequestFailed:
            raise
        except Exception as e:  # the tokenizer's or the matcher's, on this request's tokens
            message = f"the engine could not process output token {token}: {e}"
            raise RequestFailed(RequestError("INTERNAL", message)) from e

    def _add_token(
        self,
        seq: Sequence,
        token: int,
        eos_token_ids: Container[int],
        max_model_len: int,
        logprobs: PositionLogprobs | None,
    ) -> StepDelta:
        choice = self.choices[seq.index]
        params, detok = seq.params, choice.detokenizer
        seq.append_token(token)
        if logprobs is not None:
            choice.cumulative_logprob += logprobs[token].logprob
            if choice.logprobs is not None:
                choice.logprobs.append(logprobs)
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
        choice.text += text
        # The wire carries raw entries (no decoded text); prompt ones ride on the first token
        # of the first choice. Ranked sequences (best_of) carry their token's own entry, asked
        # for or not: a decode worker continuing them needs the first one.
        position = [logprobs] if logprobs is not None else None
        first = seq.index == 0 and seq.num_output_tokens == 1
        prompt = self.prompt_logprobs if first else None
        return StepDelta(seq.request_id, [token], text, reason, position, prompt, seq.index)

    def output(self) -> RequestOutput:
        """The request's result: n completions; with best_of > n the n whose tokens have the
        highest cumulative log-probability, best first, indexed in that order (as vLLM)."""
        first, params = self.seq, self.seq.params
        completions = [self._completion(c) for c in self.choices]
        if params.ranks_sequences:
            best = sorted(completions, key=lambda c: -(c.cumulative_logprob or 0.0))
            completions = [dataclasses.replace(c, index=i) for i, c in enumerate(best[: params.n])]
        seqs = [c.seq for c in self.choices]
        ended = [s.finished_time for s in seqs]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=completions,
            finished=self.is_finished,
            num_cached_tokens=first.num_cached_tokens,
            error=self.error,
            prompt_logprobs=None
            if self.prompt_logprobs is None
            else [p if p is None else self._decoded(p) for p in self.prompt_logprobs],
            metrics=RequestMetrics(
                first.arrival_time,
                first.first_token_time,
                None if None in ended else max(t for t in ended if t is not None),
                sum(s.num_preemptions for s in seqs),
            ),
        )

    def _completion(self, choice: Choice) -> CompletionOutput:
        seq = choice.seq
        out = CompletionOutput(seq.index, choice.text, seq.output_token_ids, seq.finish_reason)
        if choice.logprobs is not None or seq.params.ranks_sequences:
            out.cumulative_logprob = choice.cumulative_logprob
        if choice.logprobs is not None:
            out.logprobs = [self._decoded(p) for p in choice.logprobs]
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
        # The mask allowed only what the grammar accepts: a refusal is a fault (INTERNAL), not
        # bad input; it ends this request only.
        message = f"the structured-output matcher refused token {token}, which its mask allowed"
        raise RequestFailed(RequestError("INTERNAL", message))
    return bool(matcher.is_terminated())


def _unsampled(seq: Sequence, token: int) -> RequestError:
    """Why the runner could not sample `seq`'s row (token: NO_ALLOWED_TOKEN or
    NON_FINITE_LOGITS)."""
    n = seq.num_output_tokens
    if token == NO_ALLOWED_TOKEN and seq.grammar is not None:
        return RequestError(
            "INVALID_ARGUMENT",
            f"structured_outputs allows no token this model can write after {n} output "
            "tokens; the constraint cannot be completed.",
            "structured_outputs",
        )
    if token == NO_ALLOWED_TOKEN:
        return RequestError(
            "INVALID_ARGUMENT",
            f"the request's sampling settings left no token to sample after {n} output tokens.",
        )
    return RequestError("INTERNAL", f"the model's logits were not finite after {n} output tokens")
