"""Verifying draft tokens in one forward of the target model, exactly.

A sequence with k draft tokens runs its last token and the k drafts in one step (a multi-token
query over its paged cache, the path chunked prefill takes) and gets k + 1 rows of logits: row j
is the target's distribution p_j for the token after draft j (row 0: after the last real token).

Every row is sampled as the engine samples without speculation (penalties, grammar masks,
temperature, top-k / top-p, seeds: `ModelRunner._sample` over the rows), giving x_j ~ p_j. Draft
j is accepted while x_j equals it; the first x_j that differs, or x_k after the last draft, is the
step's last token. The proposers are deterministic (n-gram lookup, a greedy draft model), so the
draft distribution q_j is one-hot at d_j, and this is the standard rejection rule: draft d_j is
accepted with probability min(1, p_j(d_j) / q_j(d_j)) = p_j(d_j), and on rejection the token
is drawn from norm(max(0, p_j - q_j)), p_j without d_j, renormalised, which is the law of x_j
given x_j != d_j. Each token output is thus a draw from the target's own distribution given
the tokens before it: greedy output is token-identical to decoding without speculation.

A seeded request's generator is left as if only the tokens output had been drawn, one draw each
(`Sampler.skip_draw`), so its tokens are those of the same seed without speculation (up to the
float rounding of a multi-token forward against a one-token one) and survive hand-offs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.engine.outputs import PositionLogprobs
from pdmesh.engine.sample.logprobs import TopLogprobs
from pdmesh.engine.sample.sampler import Sampler


@dataclass
class Verify:
    """The draft tokens a launched step verifies, per sequence it samples (callers may rely on
    the rows' order: each sampled sequence's 1 + len(drafts) rows, in `sample_seq_index`
    order, as `ModelRunner.prepare` lays out its logits rows)."""

    drafts: list[list[int]]  # [S]: the draft tokens of each sampled sequence (often none)
    row_seqs: list[Any]  # [R]: the sequence of each logits row, R = S + total drafts
    # Seeded, sampled sequences with drafts: (index in S, generator, its state before the step)
    _rewind: list[tuple[int, torch.Generator, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, seqs: list[Any]) -> Verify | None:
        """For a step sampling `seqs` (in `sample_seq_index` order), or None when none of them
        has draft tokens (a plain step). Call before the step samples: seeded generators'
        states are saved here."""
        if not any(s.spec_token_ids for s in seqs):
            return None
        drafts = [list(s.spec_token_ids) for s in seqs]
        rows = [s for s, d in zip(seqs, drafts, strict=True) for _ in range(1 + len(d))]
        rewind = [
            (i, s.generator, s.generator.get_state())
            for i, s in enumerate(seqs)
            if drafts[i] and s.generator is not None and not s.params.greedy
        ]
        return cls(drafts, rows, rewind)

    @property
    def num_rows(self) -> int:
        return len(self.row_seqs)

    def accept(self, tokens: list[int]) -> list[list[int]]:
        """tokens [R]: the token sampled at every row. Per sampled sequence, the tokens the step
        outputs: its accepted drafts, then the token sampled where the first draft was rejected
        (or after the last one). Seeded generators are rewound to one draw per token output."""
        if len(tokens) != self.num_rows:
            raise RuntimeError(f"{len(tokens)} tokens sampled for {self.num_rows} rows")
        out: list[list[int]] = []
        row = 0
        for drafts in self.drafts:
            sampled = tokens[row : row + 1 + len(drafts)]
            row += 1 + len(drafts)
            a = 0
            while a < len(drafts) and drafts[a] == sampled[a]:
                a += 1
            out.append(sampled[: a + 1])
        for i, generator, state in self._rewind:
            generator.set_state(state)
            for _ in out[i]:
                Sampler.skip_draw(generator)
        return out

    def logprobs(
        self, top: TopLogprobs, wanted: list[int | None], tokens: list[int], out: list[list[int]]
    ) -> list[list[PositionLogprobs | None]]:
        """Per sampled sequence, the log-probability entries of the tokens it outputs (rows of
        `top`, computed over every row; `wanted` per row)."""
        entries = top.rows(tokens, wanted)
        result, row = [], 0
        for drafts, emitted in zip(self.drafts, out, strict=True):
            result.append(entries[row : row + len(emitted)])
            row += 1 + len(drafts)
        return result
