"""Paged KV-cache bookkeeping: fixed-size blocks, reference counts, hash-chained prefix caching.

The block manager never touches tensors; it hands out block ids. A block is free when no sequence
references it. A free block that holds a full, hashed prefix stays findable by its hash until it
is handed out again (evicted least recently freed first), so a later request with the same
prefix reuses it without recomputing.

A request with several choices forks: each choice takes a reference to every block of the
prompt's sequence (`fork`). A block held by more than one sequence is never written: the
first write into a shared, partly filled last block gives the writer a copy (copy on write),
and the (source, copy) pair waits in `take_copies` for the step that must copy the KV first.

With a host tier (`host`, engine/kv_cache/host/index.py), a cached block that is handed out again is
first offered to it, and a prefix continues through it where the device cache has no block: such
a block gets a fresh device block, and the copies wait in `take_host_copies` for the step that
must run them (before anything writes those blocks), or in `take_offloads` for a copy at once
(blocks a KV receiver writes).
"""

from __future__ import annotations

from collections import OrderedDict

from pdmesh.engine.kv_cache.blocks import NO_PREFIX, Block, Prefix
from pdmesh.engine.kv_cache.host.index import HostCopies, HostHit, HostIndex
from pdmesh.engine.sequence import Sequence
from pdmesh.prefix_hash import ROOT_HASH, hash_block, hash_chain


class BlockManager:
    """Protocol: `match_prefix` -> `can_allocate` -> `allocate`, then `cache_full_blocks` after each
    step that computed KV, and `free` when the sequence finishes or is preempted. The engine's
    scheduler is its only caller (engine/scheduling/scheduler.py)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host: HostIndex | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one token, got {num_blocks}x{block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.reset_counters()
        self._copies: list[tuple[int, int]] = []  # (source, copy) blocks, for the next step
        self.host = host if enable_prefix_caching else None

    def reset_counters(self) -> None:
        """Zero what the stats count since start (prefix lookups, forks, copies on write)."""
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_forked_blocks = 0  # block references taken by forks (blocks shared)
        self.num_block_copies = 0  # copies on write

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> Prefix:
        """Cached blocks holding a prefix of `seq`'s tokens, checked token by token: each from
        the device cache, or else from the host tier.

        At least one token is left uncached so the step that finishes the prompt has a position
        to sample from. Takes no references: pass the result to `allocate`.
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        bs = self.block_size
        matched: list[int | HostHit] = []
        parent = ROOT_HASH
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start : start + bs])
            h = hash_block(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is not None:
                block = self.blocks[block_id]
                if block.token_ids != tokens or block.parent_hash != parent:
                    break  # a hash collision: never serve another prefix's KV
                matched.append(block_id)
            elif self.host is not None and self.host.lookup(h, parent, tokens):
                matched.append(HostHit(h, parent, tokens))
            else:
                break
            parent = h
        return Prefix(tuple(matched))

    # -- allocation ---------------------------------------------------------------------------
    def _new_blocks_needed(self, seq: Sequence, num_new_tokens: int, prefix: Prefix) -> int:
        computed = len(prefix) * self.block_size if prefix else seq.num_computed_tokens
        held = len(prefix) if prefix else len(seq.block_table)
        return max(0, self.blocks_for(computed + num_new_tokens) - held)

    def _shared_write(self, seq: Sequence, write_from: int | None) -> int | None:
        """The index in `seq`'s table of a block shared with other sequences that a write from
        position `write_from` (default: its computed count) lands in, if any."""
        pos = seq.num_computed_tokens if write_from is None else write_from
        i = pos // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            return i
        return None

    def fits_held(self, seq: Sequence, num_new_tokens: int, write_from: int | None = None) -> bool:
        """Whether `seq`'s own blocks already take `num_new_tokens` more tokens and the block
        written first is not shared: `allocate` then takes nothing. A decode step's usual case,
        checked before the general path (at 512 sequences a step, that path's repeated checks
        cost milliseconds)."""
        # `_new_blocks_needed` and `_shared_write` inlined: called for each of 512 sequences a
        # step, their calls were most of its cost.
        table, bs = seq.block_table, self.block_size
        computed = seq.num_computed_tokens
        if not table or -(-(computed + num_new_tokens) // bs) > len(table):
            return False
        i = (computed if write_from is None else write_from) // bs
        return i >= len(table) or self.blocks[table[i]].ref_count <= 1

    def blocks_needed(
        self, seq: Sequence, num_new_tokens: int, write_from: int | None = None
    ) -> int:
        """Free blocks that `allocate(seq, num_new_tokens, write_from=write_from)` takes."""
        copy = self._shared_write(seq, write_from) is not None
        return self._new_blocks_needed(seq, num_new_tokens, NO_PREFIX) + copy

    def can_allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix: Prefix = NO_PREFIX,
        spare: int = 0,
        write_from: int | None = None,
    ) -> bool:
        """Whether `seq` can get slots for `num_new_tokens` more tokens (after taking `prefix`),
        leaving `spare` blocks free for others; `write_from`: see `allocate`."""
        if not prefix and self.fits_held(seq, num_new_tokens, write_from):
            return spare <= len(self._free)
        # Adopting a free cached block takes it out of the free pool too, as does loading a
        # block from the host tier.
        adopted_free = sum(
            1 for b in prefix.blocks if isinstance(b, HostHit) or self.blocks[b].ref_count == 0
        )
        needed = self._new_blocks_needed(seq, num_new_tokens, prefix)
        if not prefix:
            needed += self._shared_write(seq, write_from) is not None
        return needed + adopted_free + spare <= len(self._free)

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix: Prefix = NO_PREFIX,
        write_from: int | None = None,
    ) -> None:
        """Give `seq` slots for `num_new_tokens` tokens past its computed ones.

        `prefix` (from `match_prefix`, only for a sequence holding no blocks) is adopted first and
        counts as computed. The step writes from position `write_from` (default: the computed
        count; a step launched before the previous one's tokens are read writes from
        `num_tokens`): a shared block there is copied first (`take_copies`). Call
        `can_allocate` first: this raises if blocks run out.
        """
        if not prefix and self.fits_held(seq, num_new_tokens, write_from):
            return
        if not self.can_allocate(seq, num_new_tokens, prefix, write_from=write_from):
            raise RuntimeError(f"out of KV blocks allocating {num_new_tokens} tokens for {seq}")
        shared = None if prefix else self._shared_write(seq, write_from)
        if shared is not None:
            source = seq.block_table[shared]
            self.blocks[source].ref_count -= 1  # others still hold it: never freed here
            seq.block_table[shared] = copy = self._pop_free()
            self._copies.append((source, copy))
            self.num_block_copies += 1
        if not seq.block_table:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(prefix.device) * self.block_size
        if prefix:
            if seq.block_table:
                raise RuntimeError(f"{seq} already holds blocks; a prefix can only start a table")
            self._adopt(seq, prefix)
        for _ in range(self._new_blocks_needed(seq, num_new_tokens, NO_PREFIX)):
            seq.block_table.append(self._pop_free())

    def _adopt(self, seq: Sequence, prefix: Prefix) -> None:
        """`seq`'s table becomes `prefix`: its device blocks taken first (a block popped for a
        host hit may evict any free one), then a fresh block for each host hit, its load
        recorded and the block published under the hit's hash."""
        for block_id in prefix.device:
            self._take(block_id)
        hits = prefix.host
        slots = iter(self.host.claim(hits) if self.host is not None and hits else ())
        table = []
        for b in prefix.blocks:
            if isinstance(b, HostHit):
                assert self.host is not None
                block_id = self._pop_free()
                block = self.blocks[block_id]
                block.hash, block.parent_hash, block.token_ids = b
                self._cached.setdefault(b.hash, block_id)
                self.host.load(next(slots), block_id)
                b = block_id
            table.append(b)
        seq.block_table = table
        seq.block_hashes = [self.blocks[b].hash for b in table]  # type: ignore[misc]
        seq.num_computed_tokens = len(prefix) * self.block_size

    def _pop_free(self) -> int:
        """The next free block, taken (ref count 1) and out of the prefix cache (its KV offered
        to the host tier first)."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix entry: the KV will be overwritten
            if self._cached.get(block.hash) == block_id:
                del self._cached[block.hash]
                if self.host is not None:
                    assert block.parent_hash is not None and block.token_ids is not None
                    self.host.offload(block_id, block.hash, block.parent_hash, block.token_ids)
            block.forget()
        block.ref_count = 1
        return block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (holding nothing) shares every block of `parent`, and its published hashes."""
        self.share(parent, child)
        self.num_forked_blocks += len(parent.block_table)

    def share(self, parent: Sequence, child: Sequence) -> None:
        """`child` (holding nothing) takes a reference to every block of `parent` (and its
        published hashes): the blocks stay allocated, their KV intact, until `free(child)`."""
        if child.block_table:
            raise RuntimeError(f"{child} already holds blocks; only an empty one can fork")
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The (source, copy) block pairs allocated since the last call: the next step copies
        their KV on every rank before it runs."""
        copies, self._copies = self._copies, []
        return copies

    def is_loading(self, seq: Sequence) -> bool:
        """Whether a block of `seq` waits for its KV from the host tier (a pending load)."""
        host = self.host
        return host is not None and any(host.is_loading(b) for b in seq.block_table)

    def take_offloads(self) -> tuple[tuple[int, int], ...]:
        """The host tier's offloads recorded since the last step, for a copy now (see
        `HostIndex.take_offloads`)."""
        return self.host.take_offloads() if self.host is not None else ()

    def take_host_copies(self) -> HostCopies:
        """The host-tier copies recorded since the last call (none without a tier): the step
        being scheduled runs them on every rank before its forward (and before `take_copies`'
        copies)."""
        return self.host.take_copies() if self.host is not None else HostCopies((), ())

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; its computed prefix stays cached until evicted."""
        # Freed in reverse so that a sequence's tail is evicted before its head: heads are the
        # parts most often shared.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if self.host is not None and self.host.cancel_load(block_id):
                    self._uncache(block)  # (a reservation given up) its KV never came
                self._free[block_id] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"block {block_id} freed twice")
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Free `seq`'s blocks past its computed tokens (speculative decoding: the slots of
        rejected draft tokens). Such blocks were taken by the step that wrote them, for `seq`
        alone, and hold no published hash."""
        keep = self.blocks_for(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count != 0 or block.hash is not None:
                raise RuntimeError(f"block {block_id} past {seq}'s computed tokens is shared")
            self._free[block_id] = None
        del seq.block_table[keep:]

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks of `seq` that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first, end = len(seq.block_hashes), seq.num_computed_tokens // bs
        if end <= first:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
        hashes = hash_chain(parent, seq.token_ids[first * bs : end * bs], bs)
        for i, h in enumerate(hashes, first):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._cached:
                tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.hash, block.parent_hash, block.token_ids = h, parent, tokens
                self._cached[h] = block.block_id
            parent = h
        seq.block_hashes += hashes

    # -- blocks filled from outside (a KV store) ----------------------------------------------
    def hold_free(self, n: int) -> list[int] | None:
        """Take `n` free blocks for KV written from outside (no sequence holds them), or None
        when fewer than `n` are free. Cached ones among them are evicted (offered to the host
        tier: `take_offloads`). Then `publish_held` or `release_held` them."""
        if n < 1 or n > len(self._free):
            return None
        return [self._pop_free() for _ in range(n)]

    def publish_held(self, token_ids: list[int], first_block: int, block_ids: list[int]) -> int:
        """Held blocks now hold the KV of full blocks first_block, first_block + 1, ... of
        `token_ids`: each joins the prefix cache under its chained hash (unless another block
        holds that prefix already) and is freed, so `match_prefix` finds it. Returns how many
        joined."""
        bs = self.block_size
        end = first_block + len(block_ids)
        hashes = hash_chain(ROOT_HASH, token_ids[: end * bs], bs)
        joined = 0
        for i, block_id in enumerate(block_ids, first_block):
            block = self.blocks[block_id]
            h = hashes[i]
            if self.enable_prefix_caching and h not in self._cached:
                block.hash, block.token_ids = h, tuple(token_ids[i * bs : (i + 1) * bs])
                block.parent_hash = hashes[i - 1] if i else ROOT_HASH
                self._cached[h] = block_id
                joined += 1
        self._release(block_ids)
        return joined

    def release_held(self, block_ids: list[int]) -> None:
        """Held blocks whose KV did not come: freed, in no prefix cache."""
        self._release(block_ids)

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):  # a chain's tail is evicted before its head
            block = self.blocks[block_id]
            if block.ref_count != 1 or block_id in self._free:
                raise RuntimeError(f"block {block_id} is not held")
            block.ref_count = 0
            self._free[block_id] = None

    def cached_blocks(self, token_ids: list[int]) -> list[int]:
        """The device blocks holding the leading full blocks of `token_ids` now (tokens and
        parents checked), up to the first one the device cache lacks."""
        bs = self.block_size
        found: list[int] = []
        parent = ROOT_HASH
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = hash_block(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:
                break
            found.append(block_id)
            parent = h
        return found

    def _uncache(self, block: Block) -> None:
        if block.hash is not None and self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.forget()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held by a free block (used blocks keep theirs), and the
        host tier's."""
        for block_id in self._free:
            block = self.blocks[block_id]
            self._uncache(block)
        if self.host is not None:
            self.host.clear()
