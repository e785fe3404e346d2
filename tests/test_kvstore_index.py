"""The KV store's index on its own: a held key is a hit only with its tokens and its parent, and
a block a Get reads (pinned) is never evicted to make room."""

from __future__ import annotations

from kvstore_support import GEOMETRY, tokens_of

from pdmesh.kvstore_service.index import BlockIndex, BlockKey, Match, block_keys


def test_a_held_key_with_other_tokens_or_another_parent_is_a_miss() -> None:
    tokens = tokens_of(seed=2, blocks=4)
    # A key that is held but names other tokens (a hash collision) or another parent is a miss.
    index, keys = BlockIndex(4), block_keys(tokens, GEOMETRY.block_size)
    index.commit(index.reserve(keys[:2]))
    other = BlockKey(keys[1].key, keys[1].parent, block_keys(tokens_of(5, 1), 4)[0].tokens)
    orphan = BlockKey(keys[1].key, 12345, keys[1].tokens)
    assert index.match(keys[:2]) == Match(2, mismatch=False)
    assert index.match([keys[0], other]) == Match(1, mismatch=True)
    assert index.match([keys[0], orphan]) == Match(1, mismatch=True)
    assert index.pin([keys[0], other]) is None


def test_pinned_blocks_are_never_evicted() -> None:
    index = BlockIndex(3)
    held = block_keys(tokens_of(20, 2), GEOMETRY.block_size)
    index.commit(index.reserve(held))
    pinned = index.pin(held)
    assert pinned is not None
    wanted = block_keys(tokens_of(21, 3), GEOMETRY.block_size)
    room = index.reserve(wanted)
    assert len(room.slots) == 1 and not set(room.slots) & set(pinned.slots)
    assert index.stats().evictions == 0
    index.release(room)
    index.unpin(pinned)
    room = index.reserve(wanted)
    assert len(room.slots) == 3 and index.stats().evictions == 2
    assert index.match(held).hits == 0
