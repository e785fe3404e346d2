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
    """A recorder whose sends complete on demand, noting the thread that posted each and the
    order of pushes and sends."""

    def __init__(self) -> None:
        super().__init__()
        self.works: list[_Work] = []
        self.threads: list[str] = []
        self.events: list[str] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> object:
        import threading

        super().send(tensors, dst, tag)
        self.threads.append(threading.current_thread().name)
        self.events.append("send")
        self.works.append(_Work())
        return self.works[-1]

    def push(self, value: bytes) -> None:
        super().push(value)
        self.events.append("push")


def _frame(header: bytes, value: int, size: int = 8) -> object:
    from pdmesh.kv_transfer.p2p_poster import Frame

    return Frame(header, torch.full((size,), value, dtype=torch.uint8), None)


def test_small_frames_go_from_the_pairs_thread_joined_when_queued_together() -> None:
    """A prefill's layers, a few megabytes each, are posted by the pair's thread, never on the
    caller's (whose forward pass they would hold up); frames queued together go as one send."""
    from pdmesh.kv_transfer.p2p_poster import Pair

    rec = _Sends()
    pair = Pair(rec, rec, "test-pair-thread")
    try:
        first = _frame(b"a", 1)
        pair.put([first])
        assert first.posted.wait(10)
        rec.works[0].completed = True
        behind = [_frame(b"c", 3), _frame(b"d", 4)]
        pair.put(behind)
        assert all(f.posted.wait(10) for f in behind)
        assert rec.threads == ["test-pair-thread"] * 2 and rec.headers[1] == b"cd"
        assert torch.equal(rec.payloads[1], torch.tensor([3] * 8 + [4] * 8, dtype=torch.uint8))
        assert all(f.error is None for f in [first, *behind])
    finally:
        pair.close("done")


def test_many_bytes_go_at_once_with_every_batchs_headers_before_the_first_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frames adding up to COALESCE_BYTES go on the caller's thread even while sends are in
    flight (a prompt's cached blocks); when they make several batches, every batch's headers
    are pushed before their payloads are made and sent, so the receiver can post its receives
    sooner."""
    import threading

    from pdmesh.kv_transfer import p2p_poster
    from pdmesh.kv_transfer.p2p_poster import Pair

    monkeypatch.setattr(p2p_poster, "COALESCE_BYTES", 16)
    monkeypatch.setattr(p2p_poster, "BATCH_BYTES", 16)
    rec = _Sends()
    pair = Pair(rec, rec, "test-big")
    try:
        warm = _frame(b"w", 0)
        pair.put([warm])
        assert warm.posted.wait(10)  # no send ever completes from here on
        rec.events.clear()
        frames = [_frame(bytes([i]), i, 16) for i in range(1, 4)]

        def fill() -> None:  # the payloads made once every header is out, once for all
            rec.events.append("fill")
            for f in frames:
                f.payload.add_(100)

        for f in frames:
            f.fill = fill
        pair.put(frames)
        assert all(f.posted.is_set() and f.error is None for f in frames)
        assert rec.threads[1:] == [threading.current_thread().name] * 3
        assert rec.events == ["push"] * 3 + ["fill"] + ["send"] * 3
        assert [int(p[0]) for p in rec.payloads[1:]] == [101, 102, 103]
        small = _frame(b"s", 9, 4)
        pair.put([small])  # few bytes, a send in flight: the pair's thread posts it
        assert small.posted.wait(10) and rec.threads[-1] == "test-big"
    finally:
        pair.close("done")
