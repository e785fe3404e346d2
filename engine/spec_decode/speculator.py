"""Speculative decoding: draft tokens proposed for the sequences about to decode.

Before each step is scheduled, `Speculator.propose` gives every running sequence that decodes
(one token to run) and may speculate up to k draft tokens (`Sequence.spec_token_ids`); the
scheduler runs them after its last token, the step verifies them (engine/spec_decode/verify.py) and
`engine/spec_decode/step.py` appends the tokens accepted and rolls the rest back in the paged cache.

Who speculates: a request whose logits are shaped by its own history (penalties, logit_bias,
min_tokens) or by a grammar (structured output) decodes without drafts (its logits would need
each draft's effect on that history); so does every request of a step with more running
sequences than `disable_by_batch_size`, where the verify forward costs more than it saves.

Proposers are registered by method name (`@register_proposer`); each is deterministic, which
the exactness argument of spec_verify.py relies on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdmesh.engine.sequence import Sequence, SequenceStatus
from pdmesh.engine.spec_decode.config import SpeculativeConfig


class Proposer(ABC):
    """Callers may rely on: `propose` returns, for each sequence, a list of at most its limit of
    token ids (possibly empty), the same for the same tokens, and leaves the sequences as they
    are. `forget(seq)` is called once a sequence ends (a proposer may keep state per sequence)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def forget(self, seq: Sequence) -> None:  # noqa: B027 - most proposers keep no state
        """`seq` ended: drop what is kept for it."""


_PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(method: str) -> Callable[[Callable[..., Proposer]], Callable[..., Proposer]]:
    def add(factory: Callable[..., Proposer]) -> Callable[..., Proposer]:
        _PROPOSERS[method] = factory
        return factory

    return add


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup (vLLM's `ngram`): find the longest n-gram (prompt_lookup_min <= n <=
    prompt_lookup_max) ending the sequence that also occurs earlier in it (prompt and output),
    and propose the tokens that followed that occurrence. Among equally long matches the latest
    with a full continuation of k tokens is taken, else the latest."""

    def __init__(self, config: SpeculativeConfig, **_: Any) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        pairs = zip(seqs, limits, strict=True)
        return [self._one(s.token_ids, k) if k > 0 else [] for s, k in pairs]

    def _one(self, token_ids: list[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        if size < self.min_n + 1:
            return []
        # Candidate ends e < size - 1 of an earlier occurrence: tokens[e] is the last token.
        ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])
        if not ends.size:
            return []
        # match[c]: how many tokens ending at ends[c] equal the sequence's last ones (capped).
        match = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, self.max_n):
            pos = ends - back
            ok = alive & (pos >= 0)
            ok[ok] &= tokens[pos[ok]] == tokens[size - 1 - back]
            match += ok
            alive = ok
            if not alive.any():
                break
        best = int(match.max())
        if best < self.min_n:
            return []
        longest = ends[match == best]
        full = longest[longest + k < size]
        e = int(full[-1] if full.size else longest[-1])
        return tokens[e + 1 : e + 1 + k].tolist()


@dataclass
class SpecStats:
    """Counts since start (callers may rely on: accepted <= proposed)."""

    verify_steps: int = 0  # steps that ran draft tokens
    stood_aside_steps: int = 0  # steps where the batch was too large to speculate
    proposed: int = 0  # draft tokens run
    accepted: int = 0  # draft tokens output

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class Speculator:
    """One engine's speculation: which sequences get drafts, from its proposer; its counts."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    def active(self, num_running: int) -> bool:
        """Whether a step with `num_running` running sequences speculates."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, running: list[Sequence]) -> None:
        """Set the draft tokens of each running sequence for the step about to be scheduled
        (none where it may not speculate)."""
        for seq in running:
            seq.spec_token_ids = []
        if not running:
            return
        if not self.active(len(running)):
            self.stats.stood_aside_steps += 1
            return
        seqs = [s for s in running if self._may_speculate(s)]
        k = self.config.num_speculative_tokens
        # Drafts never run past max_tokens or max_model_len: every token a step outputs
        # (drafts accepted + one) must be one the request may still produce.
        limits = [
            min(
                k,
                s.params.max_tokens - s.num_output_tokens - 1,
                self.max_model_len - s.num_tokens - 1,
            )
            for s in seqs
        ]
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, limits), strict=True):
            seq.spec_token_ids = drafts

    @staticmethod
    def _may_speculate(seq: Sequence) -> bool:
        return (
            seq.status is SequenceStatus.RUNNING
            and seq.num_uncomputed_tokens == 1
            and not seq.params.shapes_logits
            and seq.grammar is None
        )

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.stats.proposed += num_drafts
        self.stats.accepted += num_accepted


def make_speculator(
    config: SpeculativeConfig | None, max_model_len: int, **context: Any
) -> Speculator | None:
    """The engine's speculator (None: speculation off). `context`: what a proposer may need
    (the draft model's: the target's ModelInfo, device and engine config)."""
    if config is None:
        return None
    if config.method == "draft_model":
        from pdmesh.engine.spec_decode import draft as spec_draft  # noqa: F401  registers it (it needs a ModelRunner)
    proposer = _PROPOSERS[config.method](config, **context)
    return Speculator(config, proposer, max_model_len)
