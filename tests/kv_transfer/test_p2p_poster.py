"""The pair thread that posts KV frames (p2p_poster.py), against a group and header channel
that only record what it posts."""

from __future__ import annotations

import pytest
import torch


class _Recorder:
    """A pair's group and header channel that only record what the pair thread posts."""

    def __init__(self) -> None:
        self.payloads: list[torch.Tensor] = []
        self.headers: list[bytes] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> object:
        self.payloads.append(tensors[0])
        return None

    def push(self, value: bytes) -> None:
        self.headers.append(value)

    def close(self) -> None:
        pass


def test_frames_back_to_back_in_one_buffer_are_sent_from_it() -> None:
    """A run of frames lying back to back in one buffer (layers gathered together) is one send
    straight from that buffer; frames elsewhere are joined into a send of their own."""
    from pdmesh.kv_transfer.p2p_poster import Frame, Pair

    gathered = torch.arange(64, dtype=torch.uint8)
    loose = [torch.full((16,), 7, dtype=torch.uint8), torch.full((8,), 9, dtype=torch.uint8)]
    frames = [Frame(bytes([i]), gathered[16 * i : 16 * (i + 1)], None) for i in range(4)]
    frames += [Frame(b"x", loose[0], None), Frame(b"y", loose[1], None)]
    rec = _Recorder()
    pair = Pair(rec, rec, "test-pair")
    try:
        pair.put(frames)
        for f in frames:
            assert f.posted.wait(10) and f.error is None
        first, second = rec.payloads
        assert first.data_ptr() == gathered.data_ptr() and torch.equal(first, gathered)
        assert torch.equal(second, torch.cat(loose))
        assert rec.headers == [bytes([0, 1, 2, 3]), b"xy"]
    finally:
        pair.close("done")


class _Work:
    """A send that completes when the test says so."""

    def __init__(self) -> None:
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed


class _Sends(_Recorder):
    """A recorder whose sends complete on demand, noting the thread that posted each."""

    def __init__(self) -> None:
        super().__init__()
        self.works: list[_Work] = []
        self.threads: list[str] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> object:
        import threading

        super().send(tensors, dst, tag)
        self.threads.append(threading.current_thread().name)
        self.works.append(_Work())
        return self.works[-1]


def _frame(header: bytes, value: int, size: int = 8) -> object:
    from pdmesh.kv_transfer.p2p_poster import Frame

    return Frame(header, torch.full((size,), value, dtype=torch.uint8), None)


def test_the_caller_posts_once_a_first_batch_went_and_small_frames_wait_for_the_window() -> None:
    """The first batch goes from the pair's thread (NCCL makes its communicator there); later
    ones from the caller's own thread, with no hand-over. Small frames queued while `window`
    sends are in flight are held, then go out together as one send once one completes."""
    import threading

    from pdmesh.kv_transfer.p2p_poster import Pair

    rec = _Sends()
    pair = Pair(rec, rec, "test-window", window=2)
    me = threading.current_thread().name
    try:
        first = _frame(b"a", 1)
        pair.put([first])
        assert first.posted.wait(10) and rec.threads == ["test-window"]
        second = _frame(b"b", 2)
        pair.put([second])  # one send in flight: posted at once, by this thread
        assert second.posted.is_set() and rec.threads[1] == me
        held = [_frame(b"c", 3), _frame(b"d", 4)]
        pair.put(held[:1])
        pair.put(held[1:])  # two in flight: both held, queued together
        assert not any(f.posted.wait(0.05) for f in held) and len(rec.payloads) == 2
        rec.works[0].completed = True  # one in flight completes: the held frames go as one
        assert all(f.posted.wait(10) for f in held)
        assert len(rec.payloads) == 3 and rec.headers[2] == b"cd"
        assert torch.equal(rec.payloads[2], torch.tensor([3] * 8 + [4] * 8, dtype=torch.uint8))
        assert all(f.error is None for f in [first, second, *held])
    finally:
        pair.close("done")


def test_frames_adding_up_to_a_batch_of_their_own_are_never_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever the sends in flight, queued frames of COALESCE_BYTES or more go at once (a
    prompt's cached blocks in chunks)."""
    from pdmesh.kv_transfer import p2p_poster
    from pdmesh.kv_transfer.p2p_poster import Pair

    monkeypatch.setattr(p2p_poster, "COALESCE_BYTES", 16)
    rec = _Sends()
    pair = Pair(rec, rec, "test-big", window=1)
    try:
        frames = [_frame(bytes([i]), i, 16) for i in range(4)]
        for frame in frames:  # no send ever completes
            pair.put([frame])
            assert frame.posted.wait(10) and frame.error is None
        assert len(rec.payloads) == 4
        small = _frame(b"s", 9, 4)
        pair.put([small])
        assert not small.posted.wait(0.05)
    finally:
        pair.close("done")
    assert small.posted.wait(10) and small.error == "done"
