"""Scheduler: token budget, sequence cap, admission order, preemption by recompute, and the
blocks it alone hands out (reservations for remote prefill, frees after a step in flight)."""

from __future__ import annotations

from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.scheduling.scheduler import Scheduler
from pdmesh.engine.sequence import Sequence, SequenceStatus
from pdmesh.sampling_params import SamplingParams


def _seq(name: str, n: int) -> Sequence:
    return Sequence(name, list(range(n)), SamplingParams(max_tokens=100))


def _run(sched: Scheduler) -> dict[str, int]:
    """One step as the engine does it: advance computed tokens, sample for complete ones."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(1)
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}


def test_chunked_prefill_respects_budget_and_decodes_go_first() -> None:
    sched = Scheduler(BlockManager(64, 16, False), max_num_seqs=8, max_num_batched_tokens=32)
    sched.add(_seq("short", 10))
    sched.add(_seq("long", 70))
    assert _run(sched) == {"short": 10, "long": 22}
    assert _run(sched) == {"short": 1, "long": 31}  # the running decode is served first
    assert _run(sched) == {"short": 1, "long": 17}
    assert _run(sched) == {"short": 1, "long": 1}


def test_max_num_seqs_caps_running() -> None:
    sched = Scheduler(BlockManager(64, 16, False), max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(_seq(f"r{i}", 5))
    assert set(_run(sched)) == {"r0", "r1"}
    assert len(sched.waiting) == 1


def test_preemption_frees_newest_and_recomputes_it() -> None:
    bm = BlockManager(4, 4, False)  # 16 token slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = _seq("old", 7), _seq("new", 7)
    sched.add(old)
    sched.add(new)
    _run(sched)  # both prefilled: 2 blocks each, all 4 used
    assert bm.num_free_blocks == 0
    _run(sched)  # 8 tokens each: still fits
    scheduled = _run(sched)  # old needs a 3rd block: new is preempted
    assert "old" in scheduled and "new" not in scheduled
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_table == [] and sched.num_preemptions == 1
    assert new.num_output_tokens == 2  # its output is kept and recomputed later
    sched.finish(old, "stop")
    assert _run(sched) == {"new": 9}  # prompt + 2 outputs prefilled again


def test_finish_frees_blocks_in_any_state() -> None:
    bm = BlockManager(8, 4, False)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = _seq("a", 5), _seq("b", 5)
    sched.add(a)
    sched.add(b)
    _run(sched)
    sched.finish(b, "abort")  # still waiting
    sched.finish(a, "abort")  # running
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_a_reservation_holds_blocks_until_commit_or_release() -> None:
    bm = BlockManager(8, 4, True)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seq = _seq("remote", 10)
    res = sched.reserve(seq)
    assert res is not None and res.first_block == 0 and len(res.block_ids) == 3
    assert res.uncached_tokens == 10 and sched.is_reserved("remote")
    assert bm.num_free_blocks == 5 and not sched.has_unfinished()
    assert sched.reserve(_seq("full", 24)) is None  # 6 blocks: held back, nothing taken
    assert bm.num_free_blocks == 5
    assert sched.commit("remote") is seq and seq.status is SequenceStatus.RUNNING
    assert seq.num_computed_tokens == 10 and sched.cached_prefix_tokens(list(range(10))) == 8
    again = _seq("again", 10)
    assert sched.reserve(again) is not None and again.num_cached_tokens == 8  # prefix hit
    assert sched.reserve(_seq("third", 2)) is None  # max_num_seqs: 1 running + 1 reserved
    assert sched.release("again") is again and again.status is SequenceStatus.WAITING
    assert again.block_table == [] and not sched.is_reserved("again")
    sched.finish(again, "abort")
    sched.finish(seq, "stop")
    assert bm.num_free_blocks == 8 and sched.stats().kv_blocks_used == 0


def test_blocks_of_a_sequence_ended_in_flight_are_freed_when_the_step_completes() -> None:
    bm = BlockManager(8, 4, False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _seq("a", 5), _seq("b", 6)
    sched.add(a)
    sched.add(b)
    _run(sched)
    step = sched.schedule()  # on the device now
    assert step.num_tokens == 2
    lookahead = sched.schedule_lookahead(step, [0, 1], max_model_len=64)
    assert lookahead is not None and lookahead.rows == [0, 1]
    assert sched.stats().steps_launched_ahead == 1
    sched.complete(step)  # its tokens read while the lookahead runs
    assert a.num_computed_tokens == 6
    sched.finish(b, "abort", in_flight=True)  # the lookahead still writes its blocks
    assert bm.num_used_blocks == 4
    sched.complete(lookahead.batch)
    assert bm.num_used_blocks == 2 and a.num_computed_tokens == 7
    sched.add(_seq("c", 3))
    assert sched.schedule_lookahead(lookahead.batch, [0], max_model_len=64) is None  # c waits


def test_batches_in_flight_leave_each_others_sequences_alone() -> None:
    """Pipeline stages: a step scheduled while another is in flight takes none of its
    sequences, at most `max_seqs`, and preempts only sequences not in flight."""
    bm = BlockManager(6, 4, False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(f"r{i}", 4) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule(max_seqs=2)
    assert [s.request_id for s in first.seqs] == ["r0", "r1"]
    second = sched.schedule(busy=first.seqs, max_seqs=2)
    assert [s.request_id for s in second.seqs] == ["r2", "r3"]
    assert not sched.schedule(busy=[*first.seqs, *second.seqs])
    sched.complete(first)
    for seq in first.seqs:
        seq.append_token(1)
    # r0 and r1 need a second block each: the last 2 free ones.
    third = sched.schedule(busy=second.seqs)
    assert [s.request_id for s in third.seqs] == ["r0", "r1"] and not third.preempted
    sched.complete(third)
    for seq in third.seqs:  # 5 computed of 9: positions 5..8 need a third block each
        for _ in range(4):
            seq.append_token(1)
    # None is free: the newest sequence gives way, but r3 and r2 are in flight, so r1 does
    # and r0 runs on its blocks.
    fourth = sched.schedule(busy=second.seqs)
    assert [s.request_id for s in fourth.preempted] == ["r1"]
    assert [s.request_id for s in fourth.seqs] == ["r0"]
    assert all(s.status is SequenceStatus.RUNNING for s in second.seqs)
