"""What the block manager hands out and finds: a block's bookkeeping (`Block`) and a
sequence's cached prefix (`Prefix`), a device block id or a host-tier hit per block."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from pdmesh.engine.kv_cache.host.index import HostHit


class Block:
    __slots__ = ("block_id", "hash", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def forget(self) -> None:
        self.hash = self.parent_hash = self.token_ids = None


@dataclass(frozen=True)
class Prefix:
    """A sequence's cached prefix, block by block: a device block id, or a block the host tier
    holds (loaded into a fresh device block when the prefix is allocated)."""

    blocks: tuple[int | HostHit, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[int | HostHit]:
        return iter(self.blocks)

    @property
    def device(self) -> list[int]:
        return [b for b in self.blocks if isinstance(b, int)]

    @property
    def host(self) -> list[HostHit]:
        return [b for b in self.blocks if isinstance(b, HostHit)]


NO_PREFIX = Prefix()
