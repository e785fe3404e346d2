"""Block-manager invariants under random allocate / compute / free sequences (hypothesis)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.sequence import Sequence
from pdmesh.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences draw tokens from a tiny alphabet so that prefixes are often shared."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []
        self.n = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=30), chunk=st.integers(1, 16))
    def admit(self, tokens: list[int], chunk: int) -> None:
        seq = Sequence(f"s{self.n}", tokens, SamplingParams())
        self.n += 1
        prefix = self.bm.match_prefix(seq)
        n = min(seq.num_tokens - len(prefix) * BLOCK, chunk)
        # A hit must really be this sequence's tokens.
        for j, block_id in enumerate(prefix):
            assert self.bm.blocks[block_id].token_ids == tuple(tokens[j * BLOCK : (j + 1) * BLOCK])
        if self.bm.can_allocate(seq, n, prefix):
            free_before = self.bm.num_free_blocks
            self.bm.allocate(seq, n, prefix)
            assert seq.num_computed_tokens == len(prefix) * BLOCK
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
            assert self.bm.num_free_blocks <= free_before
            seq.num_computed_tokens += n  # the step ran
            self.bm.cache_full_blocks(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), chunk=st.integers(1, 8), token=st.integers(0, 2))
    def step(self, i: int, chunk: int, token: int) -> None:
        seq = self.live[i % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)  # a sampled token
        n = min(seq.num_uncomputed_tokens, chunk)
        held = self.bm.fits_held(seq, n)  # the O(1) answer a decode step relies on
        if self.bm.can_allocate(seq, n):
            free = self.bm.num_free_blocks
            self.bm.allocate(seq, n)
            took = free - self.bm.num_free_blocks + len(self.bm.take_copies())
            assert (took == 0) == held
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        assert seq.block_table == []

    @invariant()
    def reference_counts_match_tables(self) -> None:
        refs = [0] * NUM_BLOCKS
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.bm.blocks:
            assert block.ref_count == refs[block.block_id]
        assert self.bm.num_free_blocks == refs.count(0)

    @invariant()
    def shared_blocks_are_full_and_cached(self) -> None:
        for block in self.bm.blocks:
            if block.ref_count > 1:
                assert block.hash is not None and len(block.token_ids) == BLOCK

    @invariant()
    def computed_tokens_fit_their_blocks(self) -> None:
        for seq in self.live:
            assert seq.num_computed_tokens <= len(seq.block_table) * BLOCK
            assert len(seq.block_hashes) <= seq.num_computed_tokens // BLOCK

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS  # nothing leaks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBlockManager = BlockManagerMachine.TestCase


def test_cached_block_is_verified_not_just_hashed() -> None:
    """A forged hash entry pointing at other tokens is never served."""
    bm = BlockManager(8, BLOCK)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams())
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = (9, 9, 9, 9)  # as if two prefixes collided on one hash
    b = Sequence("b", [1, 2, 3, 4, 6], SamplingParams())
    assert not bm.match_prefix(b)


def test_out_of_blocks_is_refused_without_partial_allocation() -> None:
    bm = BlockManager(2, BLOCK)
    seq = Sequence("a", list(range(12)), SamplingParams())
    assert not bm.can_allocate(seq, 12)
    assert bm.num_free_blocks == 2 and seq.block_table == []
