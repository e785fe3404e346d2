"""Hash chain over full KV blocks, shared by the block manager and the router's prefix index.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes up to that block. The hash is deterministic across processes (no PYTHONHASHSEED), which
lets a router predict a worker's cache hits from token ids alone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    return hash_chain(parent_hash, token_ids, len(token_ids))[0]


def hash_chain(parent_hash: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the full blocks of `token_ids`, each chained to the one before it (the first
    to `parent_hash`): `hash_block` of each block in turn, with the ids packed once."""
    data = memoryview(array("q", token_ids).tobytes())
    step = block_size * 8
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(parent.to_bytes(8, "little", signed=False), digest_size=8)
        h.update(data[start : start + step])
        parent = int.from_bytes(h.digest(), "little", signed=False)
        hashes.append(parent)
    return hashes


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain of hashes of every full block of `token_ids`."""
    return hash_chain(ROOT_HASH, token_ids, block_size)
