"""Frames that do not belong are dropped and counted, never written, and never stop the receiver."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Iterator

import pytest
import torch
import zmq

from pdmesh.kv_transfer import (
    FrameHeader,
    KVReceiver,
    KVSender,
    PageGeometry,
    TransferError,
    TransferSpec,
    Verdict,
)
from pdmesh.kv_transfer.frame import DTYPE_CODES, Ack
from pdmesh.kv_transfer.tcp import TcpReceiver

pytestmark = pytest.mark.timeout(30)

DST_BLOCKS = [3, 8]


@pytest.fixture
def raw_peer() -> Iterator[Callable[[str], zmq.Socket]]:
    """A bare zmq DEALER: whatever bytes a test wants on the receiver's port."""
    context = zmq.Context()
    sockets: list[zmq.Socket] = []

    def connect(endpoint: str) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close()
    context.term()


def _valid_frame(geo: PageGeometry, spec: TransferSpec) -> tuple[FrameHeader, bytes]:
    """Layer 0, all blocks, the receiver's heads: a frame the receiver would accept."""
    n = spec.num_blocks
    payload = torch.ones(2, n, geo.block_size, geo.num_kv_heads, geo.head_dim, dtype=geo.dtype)
    data = payload.view(-1).view(torch.uint8).numpy().tobytes()
    header = FrameHeader(
        transfer_id=spec.raw_id,
        token=spec.token,
        layer=0,
        first_block=0,
        num_blocks=n,
        head_start=geo.head_start,
        num_heads=geo.num_kv_heads,
        block_size=geo.block_size,
        head_dim=geo.head_dim,
        dtype_code=DTYPE_CODES[geo.dtype],
        payload_nbytes=len(data),
    )
    return header, data


def _parses(header: bytes) -> bool:
    try:
        FrameHeader.unpack(header)
    except ValueError:
        return False
    return True


def test_hostile_frames_are_dropped_by_reason_and_the_receiver_keeps_working(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    raw_peer: Callable[[str], zmq.Socket],
    eventually: Callable[[Callable[[], bool]], None],
    sentinel: float,
) -> None:
    geo = geometry(heads=2)
    rx = receiver(geo, 12)
    victim = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(victim, timeout=10)
    good, payload = _valid_frame(geo, victim)

    def frame(**change: object) -> list[bytes]:
        return [dataclasses.replace(good, **change).pack(), payload]

    fp16 = DTYPE_CODES[torch.float16]
    hostile: list[tuple[Verdict, list[bytes]]] = [
        (Verdict.UNKNOWN_TRANSFER, frame(transfer_id=secrets.token_bytes(16))),
        (Verdict.BAD_TOKEN, frame(token=secrets.token_bytes(16))),
        (Verdict.BAD_TOKEN, frame(token=bytes(16))),
        (Verdict.BAD_SIZE, [good.pack(), payload[:-1]]),  # short payload
        (Verdict.BAD_SIZE, [good.pack(), payload + b"\0"]),
        (Verdict.BAD_SIZE, frame(payload_nbytes=len(payload) + 4)),
        (Verdict.BAD_SIZE, frame(layer=geo.num_layers)),  # layer out of range
        (Verdict.BAD_SIZE, frame(first_block=1)),  # blocks [1, 3) of a 2-block transfer
        (Verdict.BAD_SIZE, frame(first_block=2**32 - 1)),
        (Verdict.BAD_SIZE, frame(num_blocks=0)),
        (Verdict.BAD_SIZE, frame(dtype_code=fp16)),
        (Verdict.BAD_SIZE, frame(dtype_code=200)),
        (Verdict.BAD_SIZE, frame(head_dim=geo.head_dim * 2)),
        (Verdict.BAD_SIZE, frame(block_size=geo.block_size // 2)),
        (Verdict.BAD_SIZE, frame(head_start=10)),  # heads this rank does not hold
        (Verdict.BAD_SIZE, frame(num_heads=0)),
        (Verdict.MALFORMED, [good.pack()]),  # missing payload part
        (Verdict.MALFORMED, [good.pack(), payload, b"extra"]),
        (Verdict.MALFORMED, [good.pack()[:-3], payload]),  # truncated header
        (Verdict.MALFORMED, [b"XXXX" + good.pack()[4:], payload]),
        (Verdict.MALFORMED, [secrets.token_bytes(75)]),  # garbage
        (Verdict.MALFORMED, [b""]),
    ]
    peer = raw_peer(rx.endpoint)
    for _, parts in hostile:
        peer.send_multipart(parts)

    counts = {verdict: sum(v is verdict for v, _ in hostile) for verdict in Verdict}
    eventually(lambda: rx.stats.frames_dropped == len(hostile))
    stats = rx.stats
    assert stats.dropped_unknown_transfer == counts[Verdict.UNKNOWN_TRANSFER]
    assert stats.dropped_bad_token == counts[Verdict.BAD_TOKEN]
    assert stats.dropped_bad_size == counts[Verdict.BAD_SIZE]
    assert stats.dropped_malformed == counts[Verdict.MALFORMED]
    assert stats.frames_received == 0 and stats.bytes_received == 0
    assert bool((rx.cache == sentinel).all())
    assert not done.done()

    # A peer hears, in order, why each frame with a readable header was refused; bytes that are
    # not a header get no answer at all.
    answered = [v for v, parts in hostile if _parses(parts[0])]
    acks = [Ack.unpack(peer.recv()) for _ in answered]
    assert [a.verdict for a in acks] == answered
    assert len(answered) == len(hostile) - 4

    # The victim transfer still completes from its real sender.
    source = random_cache(geo, 8)
    tx = sender(geo)
    handle = tx.start(rx.endpoint, victim.transfer_id, victim.token, victim.num_blocks)
    for layer in range(geo.num_layers):
        tx.send_layer(handle, layer, 0, source[layer, 0, :2], source[layer, 1, :2])
    tx.finish(handle, timeout=5)
    done.result(timeout=5)
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, :2])


def test_a_wrong_token_fails_the_sender_and_spares_the_transfer(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    geo = geometry(heads=2)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=10)
    source = random_cache(geo, 8)
    tx = sender(geo)
    handle = tx.start(rx.endpoint, spec.transfer_id, secrets.token_bytes(16), spec.num_blocks)
    tx.send_layer(handle, 0, 0, source[0, 0, :2], source[0, 1, :2])
    with pytest.raises(TransferError, match="bad_token"):
        tx.finish(handle, timeout=5)
    assert tx.stats.transfers_failed == 1
    assert bool((rx.cache == sentinel).all()) and not done.done()


def test_an_oversized_message_is_cut_off_without_harm(
    geometry: Callable[..., PageGeometry],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    raw_peer: Callable[[str], zmq.Socket],
) -> None:
    geo = geometry(heads=2)
    cache = torch.zeros(geo.cache_shape(12))
    with TcpReceiver(
        cache, geo, "tcp://127.0.0.1:0", max_frame_bytes=4 * geo.bytes_per_block
    ) as rx:
        spec = TransferSpec.new(DST_BLOCKS, 0, 2)
        done = rx.expect(spec, timeout=10)
        peer = raw_peer(rx.endpoint)
        peer.send_multipart([b"h" * 75, bytes(64 * geo.bytes_per_block)])  # zmq hangs up on it
        source = random_cache(geo, 8)
        tx = sender(geo)
        handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
        for layer in range(geo.num_layers):
            tx.send_layer(handle, layer, 0, source[layer, 0, :2], source[layer, 1, :2])
        tx.finish(handle, timeout=5)
        done.result(timeout=5)
        assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, :2])
        assert rx.stats.frames_dropped == 0  # zmq refused it before it reached the thread
