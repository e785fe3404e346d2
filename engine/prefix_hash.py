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
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain of hashes of every full block of `token_ids`."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
