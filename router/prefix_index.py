"""A router-side guess at a worker's prefix cache: the block hashes it was recently sent."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    """LRU set of block hashes; `match` counts the leading hashes present (a hash chain, so a
    present hash implies its whole prefix was sent)."""

    def __init__(self, capacity_blocks: int = 200_000) -> None:
        self.capacity = capacity_blocks
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
