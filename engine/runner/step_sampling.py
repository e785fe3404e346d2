"""Sampling a launched step's rows into its handle: the logits of the rows to sample -> the tokens
the host reads (`StepHandle`), with each row's penalties, grammar, log-probabilities and seed.

With pipeline stages the logits are on the last stage and rank 0 samples. A step whose rows are
all plain greedy (`plain_greedy`: no penalties, grammar, log-probabilities, prompt rows or draft
tokens) is sampled where its logits are instead: the last stage sends rank 0 the token ids
(`greedy_tokens`, [2, S] int64) rather than the logits ([S, V], 256 KB a row for a 128k
vocabulary in bf16, which crosses nodes when the stages do).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from pdmesh.engine.outputs import NO_ALLOWED_TOKEN, NON_FINITE_LOGITS
from pdmesh.engine.runner.step_handle import StepHandle
from pdmesh.engine.runner.step_inputs import StepInputs
from pdmesh.engine.sample import penalties, structured
from pdmesh.engine.sample.logprobs import TopLogprobs, prompt_logprobs, wanted_logprobs
from pdmesh.engine.sample.sampler import Sampler, SamplingBatch
from pdmesh.engine.scheduling.batch import ScheduledBatch


def plain_greedy(seqs: list[Any], inputs: StepInputs, verify: Any) -> bool:
    """Whether each row of the step is its logits' argmax and nothing else is read from them."""
    return (
        verify is None
        and not inputs.prompt_rows
        and all(s.params.greedy for s in seqs)
        and not penalties.shapes_logits(seqs)
        and not structured.constrained(seqs)
        and all(wanted_logprobs(s.params) is None for s in seqs)
    )


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (tokens [S], flagged [S]) int64: each row's argmax, and the same as the
    host reads it (see `flag_unsampled`)."""
    best, tokens = logits.max(dim=-1)
    return tokens, flag_unsampled(tokens, best)


def flag_unsampled(tokens: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """The host reads a row it could not sample (`best`, its largest logit, not finite) as a
    negative "token" (the request then ends alone, engine/scheduling/request.py); the device
    keeps a valid id in `tokens` for a step launched ahead, whose output for it is dropped."""
    return torch.where(
        torch.isfinite(best),
        tokens,
        torch.where(torch.isneginf(best), NO_ALLOWED_TOKEN, NON_FINITE_LOGITS),
    )


class StepSampler:
    """Rank 0's sampling of its steps' rows (the seeds' generators live on the sequences)."""

    def __init__(self, seed: int | None, eos_token_ids: Any, device: torch.device) -> None:
        self.sampler = Sampler(seed)
        self.eos_token_ids = eos_token_ids
        self.device = device

    def sample(
        self,
        handle: StepHandle,
        logits: torch.Tensor,
        seqs: list[Any],
        batch: ScheduledBatch,
        inputs: StepInputs,
        masks: Future[torch.Tensor] | None,
    ) -> None:
        """logits [S + P, V]: the step's rows to sample -> handle.tokens [S]; the prompt rows'
        log-probabilities -> handle.prompt_logprobs. masks: the constrained rows' bitmasks."""
        handle.sample = None
        if inputs.prompt_rows:
            handle.prompt_logprobs = prompt_logprobs(logits[len(seqs) :], batch, inputs)
            logits = logits[: len(seqs)]
        if not seqs:
            return
        raw = logits  # logprobs are of the model's own distribution
        eos = self.eos_token_ids
        if penalties.shapes_logits(seqs):
            logits = penalties.apply(logits, seqs, eos)
        if masks is not None:
            shaped = logits
            logits = structured.mask(shaped, masks)
            if penalties.holds_stop_under_grammar(seqs):
                # The grammar wins over min_tokens: a row whose grammar allows only stop tokens
                # gets them back rather than nothing at all (no host sync: a select per row).
                released = structured.mask(penalties.apply(raw, seqs, eos, hold_stop=False), masks)
                empty = torch.isneginf(logits).all(dim=-1, keepdim=True)
                logits = torch.where(empty, released, logits)
        if all(s.params.greedy for s in seqs):  # the common case: no per-row tensors to build
            tokens, flagged = greedy_tokens(logits)
        else:
            sampling = SamplingBatch.build(
                [s.params for s in seqs], [s.generator for s in seqs], logits.shape[-1], self.device
            )
            tokens = self.sampler(logits, sampling)
            flagged = flag_unsampled(tokens, logits.amax(dim=-1))
        wanted = [wanted_logprobs(s.params) for s in seqs]
        if any(k is not None for k in wanted):
            handle.logprobs = TopLogprobs.of(raw, tokens, max(k or 0 for k in wanted)), wanted
        self.take(handle, tokens, flagged)

    @staticmethod
    def take(handle: StepHandle, tokens: torch.Tensor, flagged: torch.Tensor) -> None:
        """A step's sampled tokens [S] (and `flagged`, as the host reads them) into its handle;
        on a GPU their copy to pinned host memory is queued, with an event after it."""
        handle.sample = None
        handle.tokens, handle.flagged = tokens, flagged
        if tokens.is_cuda:
            handle.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            handle.host_tokens.copy_(flagged, non_blocking=True)
            handle.copied = torch.cuda.Event()
            handle.copied.record()
