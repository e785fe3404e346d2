"""Logits shaped by each request's history before sampling: presence, frequency and repetition
penalties, a bias per token, and EOS held back until `min_tokens` (vLLM's definitions).

Applied on rank 0 to the rows to sample, after the logprobs' raw distribution is taken and before
temperature and filters. A step's sequences must know every token before it: the engine does not
launch a step ahead of the tokens of one whose requests shape their logits
(engine/scheduling/overlap.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch


def shapes_logits(seqs: Sequence[Any]) -> bool:
    return any(s.params.shapes_logits for s in seqs)


def holds_stop_under_grammar(seqs: Sequence[Any]) -> bool:
    """Whether a constrained sequence is still below its min_tokens (its grammar and the hold
    on stop tokens may then leave it nothing to sample: see `apply`'s hold_stop)."""
    return any(s.grammar is not None and s.num_output_tokens < s.params.min_tokens for s in seqs)


def apply(
    logits: torch.Tensor, seqs: Sequence[Any], stop_ids: Collection[int], hold_stop: bool = True
) -> torch.Tensor:
    """logits [S, V] (float32) of `seqs`' sampled rows -> the shaped logits (a new tensor).
    stop_ids: the model's EOS ids, masked with each row's own stop token ids until min_tokens
    (unless hold_stop is False: the rows a grammar would otherwise leave empty, see
    ModelRunner._sample; the grammar wins over min_tokens, as in vLLM)."""
    out = logits.float().clone()
    vocab, device = out.shape[1], out.device
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.shapes_logits:
            continue
        x = out[row]
        outputs = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=device)
        if p.repetition_penalty != 1:
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64, device=device)
            seen[prompt[prompt < vocab]] = True
            seen[outputs[outputs < vocab]] = True
            penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x.copy_(torch.where(seen, penalized, x))
        if (p.presence_penalty or p.frequency_penalty) and outputs.numel():
            counts = torch.bincount(outputs[outputs < vocab], minlength=vocab).to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
        if p.logit_bias:
            ids = [t for t in p.logit_bias if t < vocab]
            bias = torch.tensor([p.logit_bias[t] for t in ids], dtype=x.dtype, device=device)
            x[torch.tensor(ids, dtype=torch.int64, device=device)] += bias
        if hold_stop and seq.num_output_tokens < p.min_tokens:
            held = [t for t in (*stop_ids, *p.stop_token_ids) if t < vocab]
            if held:
                x[torch.tensor(held, dtype=torch.int64, device=device)] = float("-inf")
    return out
