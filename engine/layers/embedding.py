"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.weights import CheckpointTensor
from pdmesh.kernels import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        # The last rank's slice is padded with zero rows when the vocabulary does not divide.
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"{loaded.name}: {loaded.shape[0]} vocabulary rows, config says {self.vocab_size}"
            )
        n = self.end - self.start
        param.data.zero_()
        param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary slice, gathered to the full vocabulary."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: ParallelGroup = SINGLE,
        tie_to: VocabParallelEmbedding | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        if tie_to is not None:
            self.weight = tie_to.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, hidden] -> logits [S, vocab]
        logits = linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]
