"""Rank 0's index of the host-memory KV tier: which prefix blocks the host pool holds, and where.

The tier is a second level under the device prefix cache (engine/kv_cache/block_manager.py). A full,
cached block that the device cache evicts is offered here (`offload`) and copied into a host
slot by the step that reuses its device block; a prompt whose prefix continues past the device
cache's hits is looked up here (`lookup`, its tokens checked) and its blocks are copied back
into fresh device blocks (`claim`, then `load`) by the step that allocates them. Slots are
reused least recently used first.

Callers may rely on: the copies recorded since the last `take_copies` are what one step must
run, every offload before every load (a block offloaded and found again in one step is read
back after it was written); a slot that one of those copies reads or writes is pinned until
`take_copies` hands them over, so no two pending copies disagree about a slot. The index never
touches tensors (engine/kv_cache/host/pool.py does, on every rank).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class HostHit(NamedTuple):
    """A prefix block found in the host tier: its hash, its parent's and its tokens."""

    hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class HostCopies(NamedTuple):
    """One step's host-tier copies, run in this order on every rank before its forward."""

    offloads: tuple[tuple[int, int], ...]  # (device block, host slot)
    loads: tuple[tuple[int, int], ...]  # (host slot, device block)
    # No sequence of the step reads the loaded blocks: the loads may run beside its forward
    # (the next step waits for them).
    overlap: bool = False


class _Entry(NamedTuple):
    slot: int
    parent_hash: int
    token_ids: tuple[int, ...]


class HostIndex:
    """Protocol: `lookup` while matching a prefix, then `claim` and `load` for the hits a
    sequence adopts; `offload` as cached blocks are handed out again; `take_copies` once per
    step. The block manager is its only caller."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry, LRU first
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[int] = set()  # slots the pending copies read or write
        self._offloads: list[tuple[int, int]] = []
        self._loads: dict[int, int] = {}  # device block -> the slot loaded into it
        self.hit_blocks = 0  # blocks found here and loaded back instead of recomputed
        self.offloaded_blocks = 0
        self.evicted_blocks = 0  # entries dropped to make room

    def figures(self, block_size: int, block_bytes: int, seconds: float) -> dict[str, float]:
        """The tier's `EngineStats` fields; `block_bytes`: a block's KV over the worker's
        ranks; `seconds`: rank 0's copy time."""
        return {
            "host_tier_blocks_total": self.num_slots,
            "host_tier_blocks_used": len(self._entries),
            "host_tier_hit_blocks": self.hit_blocks,
            "host_tier_hit_tokens": self.hit_blocks * block_size,
            "host_tier_offloaded_bytes": self.offloaded_blocks * block_bytes,
            "host_tier_loaded_bytes": self.hit_blocks * block_bytes,
            "host_tier_copy_seconds": seconds,
        }

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether the tier holds this block: its hash, parent and tokens all match (a hash
        collision is a miss). Changes nothing."""
        entry = self._entries.get(block_hash)
        return (
            entry is not None and entry.parent_hash == parent_hash and entry.token_ids == token_ids
        )

    def offload(
        self, block_id: int, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]
    ) -> None:
        """The device cache evicts `block_id` holding this block: keep a copy (recorded for the
        next step) unless the tier holds it already or every slot is pinned (then it is lost)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self._entries[block_hash] = _Entry(slot, parent_hash, token_ids)
        self._pinned.add(slot)
        self._offloads.append((block_id, slot))
        self.offloaded_blocks += 1

    def claim(self, hits: list[HostHit]) -> list[int]:
        """The slots of `hits` (each found by `lookup` just now), pinned and made the most
        recently used: call before allocating their device blocks, which may evict (and offload)
        other blocks, so that no slot of theirs is reused meanwhile."""
        slots = []
        for hit in hits:
            self._entries.move_to_end(hit.hash)
            slots.append(self._entries[hit.hash].slot)
        self._pinned.update(slots)
        self.hit_blocks += len(hits)
        return slots

    def load(self, slot: int, block_id: int) -> None:
        """Record a claimed slot's copy into device block `block_id`, for the next step."""
        self._loads[block_id] = slot

    def cancel_load(self, block_id: int) -> bool:
        """Drop the pending load into `block_id` (freed before any step ran it); whether there
        was one."""
        return self._loads.pop(block_id, None) is not None

    def is_loading(self, block_id: int) -> bool:
        """Whether a load into `block_id` waits in the pending copies."""
        return block_id in self._loads

    def take_offloads(self) -> tuple[tuple[int, int], ...]:
        """The offloads recorded since the last `take_copies`, to be run right now instead of
        by the next step (their blocks are written by a KV receiver, not a step)."""
        offloads = tuple(self._offloads)
        self._offloads = []
        self._pinned = set(self._loads.values())  # slots pending loads still read
        return offloads

    def take_copies(self) -> HostCopies:
        """The copies recorded since the last call, for the step being scheduled (which runs
        them); their slots are unpinned."""
        loads = tuple((slot, block_id) for block_id, slot in self._loads.items())
        copies = HostCopies(tuple(self._offloads), loads)
        self._offloads, self._loads = [], {}
        self._pinned.clear()
        return copies

    def clear(self) -> None:
        """Forget every entry but those a pending copy reads or writes."""
        for block_hash, entry in list(self._entries.items()):
            if entry.slot not in self._pinned:
                del self._entries[block_hash]
                self._free_slots.append(entry.slot)

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, e in self._entries.items() if e.slot not in self._pinned), None)
        if victim is None:
            return None
        self.evicted_blocks += 1
        return self._entries.pop(victim).slot
