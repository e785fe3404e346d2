"""Which block sits in which slot of the store's pool: keys, token checks, pins and LRU eviction.

A block's key is the chained prefix hash of pdmesh/prefix_hash.py over its tokens and all tokens
before it; an entry also keeps the block's own tokens and its parent's key, and a block counts
as held only when all three match the asker's (`match`), so a hash collision is a miss, never
someone else's KV. The pool has a fixed number of slots (the byte budget over one block's
bytes). The protocol, per call of the store:

    Lookup: match(keys)                       -> leading blocks held
    Put:    reserve(blocks) -> slots          the transfer writes them; then
            commit(reservation) | release(reservation)
    Get:    pin(blocks) -> slots              the transfer reads them; then unpin(pinned)

Eviction takes the least recently used entry that no Get has pinned, so a slot is never handed
to a Put while a Get still reads it. Every touch refreshes a block together with all its held
ancestors, leaf first, so an ancestor is always more recent than its descendants and eviction
takes leaves first: a chain shrinks from its end and never loses the root its tail hangs off.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdmesh.prefix_hash import ROOT_HASH, hash_prefix_blocks


@dataclass(frozen=True)
class BlockKey:
    """One full block as an asker names it."""

    key: int  # the chained hash through this block
    parent: int  # the key of the block before it (ROOT_HASH for the first)
    tokens: bytes  # its token ids, uint32 each


def block_keys(token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of every full block of `token_ids` (a partial last block has none)."""
    hashes = hash_prefix_blocks(token_ids, block_size)
    packed = array("I", token_ids[: len(hashes) * block_size]).tobytes()
    step = 4 * block_size
    return [
        BlockKey(h, hashes[i - 1] if i else ROOT_HASH, packed[i * step : (i + 1) * step])
        for i, h in enumerate(hashes)
    ]


@dataclass
class _Entry:
    slot: int
    parent: int
    tokens: bytes
    pins: int = 0


@dataclass(frozen=True)
class Match:
    """What `match` found: the leading blocks held, and whether the next one was a key held
    with other tokens or another parent (a hash collision)."""

    hits: int
    mismatch: bool


@dataclass(eq=False)
class Reservation:
    """Slots for a Put in flight: `blocks[i]` arrives in `slots[i]`."""

    blocks: list[BlockKey]
    slots: list[int]


@dataclass(eq=False)
class Pinned:
    """Blocks a Get reads: `slots[i]` holds the i-th block asked for."""

    slots: list[int]
    _entries: list[_Entry] = field(repr=False)
    tokens: bytes = field(default=b"", repr=False)  # the blocks' own tokens (uint32 each)


@dataclass(frozen=True)
class IndexStats:
    capacity_blocks: int
    blocks_held: int
    blocks_pinned: int  # held blocks some Get reads
    blocks_filling: int  # slots reserved by Puts in flight
    evictions: int


class BlockIndex:
    """Callers may rely on: every method is thread-safe; a slot returned by `reserve` belongs to
    that reservation alone until `commit` or `release`, and a slot returned by `pin` keeps its
    block, unevicted and unmoved, until `unpin`; nothing is evicted but to make room in
    `reserve`, and then only the least recently used unpinned entries."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a block index needs at least one slot, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # key -> entry, LRU first
        self._free = list(range(capacity_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._filling = 0  # slots reserved by Puts in flight
        self._pinned = 0  # entries with pins
        self._evictions = 0

    # -- Lookup ----------------------------------------------------------------------------------
    def match(self, blocks: Sequence[BlockKey]) -> Match:
        """How many leading `blocks` are held with their tokens and parent; refreshes them."""
        with self._lock:
            hits, mismatch = 0, False
            for block in blocks:
                entry = self._entries.get(block.key)
                if entry is None:
                    break
                if entry.tokens != block.tokens or entry.parent != block.parent:
                    mismatch = True
                    break
                hits += 1
            if hits:
                self._touch(blocks[hits - 1].key)
            return Match(hits, mismatch)

    # -- Get -------------------------------------------------------------------------------------
    def pin(self, blocks: Sequence[BlockKey]) -> Pinned | None:
        """Pin every one of `blocks` (all held, tokens and parents matching) or none: None."""
        with self._lock:
            entries = []
            for block in blocks:
                entry = self._entries.get(block.key)
                if entry is None or entry.tokens != block.tokens or entry.parent != block.parent:
                    return None
                entries.append(entry)
            for entry in entries:
                if entry.pins == 0:
                    self._pinned += 1
                entry.pins += 1
            if blocks:
                self._touch(blocks[-1].key)
            tokens = b"".join(e.tokens for e in entries)
            return Pinned([e.slot for e in entries], entries, tokens)

    def unpin(self, pinned: Pinned) -> None:
        with self._lock:
            for entry in pinned._entries:
                entry.pins -= 1
                if entry.pins == 0:
                    self._pinned -= 1
            pinned._entries = []  # a second unpin does nothing

    # -- Put -------------------------------------------------------------------------------------
    def reserve(self, blocks: Sequence[BlockKey]) -> Reservation:
        """Slots for as many leading `blocks` as fit: free slots first, then slots of evicted
        least recently used unpinned entries. Fewer (maybe none) when the rest are pinned or
        filling."""
        with self._lock:
            wanted = len(blocks)
            slots = [self._free.pop() for _ in range(min(wanted, len(self._free)))]
            if len(slots) < wanted:
                victims = []
                for key, entry in self._entries.items():  # least recently used first
                    if entry.pins == 0:
                        victims.append(key)
                        if len(slots) + len(victims) == wanted:
                            break
                for key in victims:
                    slots.append(self._entries.pop(key).slot)
                self._evictions += len(victims)
            self._filling += len(slots)
            return Reservation(list(blocks[: len(slots)]), slots)

    def commit(self, reservation: Reservation) -> int:
        """The reservation's blocks arrived: hold them; returns how many are new. A block whose
        key is already held keeps the held copy, and blocks whose parent is no longer held
        (evicted meanwhile) are dropped, as no lookup could reach them."""
        with self._lock:
            self._filling -= len(reservation.slots)
            stored, last = 0, None
            for block, slot in zip(reservation.blocks, reservation.slots, strict=True):
                reachable = block.parent == ROOT_HASH or block.parent in self._entries
                if block.key in self._entries or not reachable:
                    self._free.append(slot)
                    continue
                self._entries[block.key] = _Entry(slot, block.parent, block.tokens)
                stored += 1
                last = block.key
            if last is not None:
                self._touch(last)
            reservation.slots = []
            return stored

    def release(self, reservation: Reservation) -> None:
        """The reservation's transfer failed: its slots are free again."""
        with self._lock:
            self._filling -= len(reservation.slots)
            self._free.extend(reservation.slots)
            reservation.slots = []

    # -- figures ---------------------------------------------------------------------------------
    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                capacity_blocks=self.capacity_blocks,
                blocks_held=len(self._entries),
                blocks_pinned=self._pinned,
                blocks_filling=self._filling,
                evictions=self._evictions,
            )

    def _touch(self, key: int) -> None:
        """Make `key`'s entry and its held ancestors the most recently used, the root last."""
        chain = []
        for _ in range(len(self._entries)):  # bounded: a colliding key could close a loop
            entry = self._entries.get(key)
            if entry is None:
                break
            chain.append(key)
            key = entry.parent
        for k in chain:
            self._entries.move_to_end(k)
