"""The dispatch policy contract: which decode worker, and which prefill worker (if any)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdmesh.router.registry import Worker


@dataclass(frozen=True)
class PromptInfo:
    num_tokens: int
    block_hashes: list[int]  # hash chain of the prompt's full blocks
    block_size: int

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)


@dataclass(frozen=True)
class Decision:
    decode: Worker
    prefill: Worker | None  # None: the decode worker prefills the prompt itself
    reason: str  # why, for logs and trace attributes
    prefill_miss_blocks: int = 0  # blocks the prefill worker is expected to compute


class DispatchPolicy(ABC):
    """Callers may rely on: `choose` returns a decode worker from `decode` (never empty) and a
    prefill worker from `prefill` or None; it does not mutate worker state."""

    def __init__(self, overlap_weight: float, disagg_min_tokens: int) -> None:
        self.overlap_weight = overlap_weight
        self.disagg_min_tokens = disagg_min_tokens

    @abstractmethod
    def choose(
        self, prompt: PromptInfo, decode: list[Worker], prefill: list[Worker]
    ) -> Decision: ...

    def local_prefill(self, prompt: PromptInfo, decode: Worker) -> bool:
        """Whether the decode worker's likely-uncached part of the prompt is short enough to
        prefill there (the worker checks again against its real cache)."""
        cached = decode.index.match(prompt.block_hashes) * prompt.block_size
        return prompt.num_tokens - cached < self.disagg_min_tokens
