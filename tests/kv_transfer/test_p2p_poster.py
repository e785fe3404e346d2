"""The pair thread that posts KV frames (p2p_poster.py), against a group and header channel
that only record what it posts."""

from __future__ import annotations

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
