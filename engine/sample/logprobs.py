"""Log-probabilities of chosen tokens and their most likely alternatives, from a step's logits.

Computed on the logits' device right after sampling (the raw model distribution, as vLLM's
default `raw_logprobs`: no temperature or filters applied), read on the host with the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdmesh.engine.outputs import Logprob, PositionLogprobs
from pdmesh.sampling_params import SamplingParams


def wanted_logprobs(params: SamplingParams) -> int | None:
    """Alternatives to compute with each sampled token (None: no log-probabilities): those
    asked for, or none but the token's own when best_of ranks the sequences by it."""
    if params.logprobs is None and params.ranks_sequences:
        return 0
    return params.logprobs


@dataclass
class TopLogprobs:
    """Per row: the chosen token's log-probability and rank, and the k most likely tokens."""

    token_logprob: torch.Tensor  # [R] float32
    token_rank: torch.Tensor  # [R] int64, 1 = the most likely
    top_ids: torch.Tensor  # [R, k] int64
    top_logprobs: torch.Tensor  # [R, k] float32

    @staticmethod
    def of(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> TopLogprobs:
        """logits [R, V], chosen [R] token ids, k alternatives per row."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        token = lp.gather(1, chosen.view(-1, 1).to(torch.int64)).squeeze(1)
        rank = (lp > token.unsqueeze(1)).sum(dim=1) + 1
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen.new_empty(0, 0))
        return TopLogprobs(token, rank, top_ids.view(lp.shape[0], k), top_lp)

    def rows(self, chosen: list[int], wanted: list[int | None]) -> list[PositionLogprobs | None]:
        """Per row, the chosen token's entry then its `wanted` alternatives (None: not asked)."""
        token_lp, rank = self.token_logprob.tolist(), self.token_rank.tolist()
        top_ids, top_lp = self.top_ids.tolist(), self.top_logprobs.tolist()
        out: list[PositionLogprobs | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
                continue
            entry = {chosen[i]: Logprob(token_lp[i], rank[i])}
            for j in range(k):
                entry.setdefault(top_ids[i][j], Logprob(top_lp[i][j], j + 1))
            out.append(entry)
        return out


def prompt_logprobs(
    logits: torch.Tensor, batch: Any, inputs: Any
) -> list[tuple[int, int, PositionLogprobs]]:
    """logits [P, V] of a step's prompt rows (`StepInputs.prompt_rows`: batch row, position):
    each predicts the prompt's next token. Returns (batch row, position, entry) of each."""
    rows = inputs.prompt_rows
    targets = [batch.seqs[i].token_ids[p + 1] for i, p in rows]
    wanted = [batch.seqs[i].params.prompt_logprobs for i, _ in rows]
    chosen = torch.tensor(targets, device=logits.device)
    top = TopLogprobs.of(logits, chosen, max(k or 0 for k in wanted))
    entries = top.rows(targets, wanted)
    return [(i, p, e) for (i, p), e in zip(rows, entries, strict=True) if e is not None]
