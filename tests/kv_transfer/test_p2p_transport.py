"""The process-group transport (`gloo` here; `nccl` is the same code on GPUs): real groups."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdmesh.kv_transfer import (
    KVReceiver,
    KVSender,
    PageGeometry,
    TransferError,
    TransferSpec,
    create_receiver,
    create_sender,
)

GEO = dict(num_layers=3, block_size=4, head_dim=8, dtype=torch.float32)


def _pair(heads: int = 2, head_start: int = 0):
    geo = PageGeometry(num_kv_heads=heads, head_start=head_start, **GEO)
    cache = torch.full(geo.cache_shape(8), -1.0)
    rx = create_receiver("gloo", cache, geo, "tcp://127.0.0.1:0")
    return geo, cache, rx


def _send_one_block(
    tx: KVSender,
    rx: KVReceiver,
    cache: torch.Tensor,
    src: torch.Tensor,
    src_block: int,
    dst_block: int,
) -> None:
    """Block `src_block` of every layer of `src` into the receiver's `dst_block`, checked."""
    spec = TransferSpec.new([dst_block], 0, 2)
    done = rx.expect(spec, timeout=30)
    h = tx.start(rx.endpoint, spec.transfer_id, spec.token, 1)
    block = slice(src_block, src_block + 1)
    for layer in range(src.shape[0]):
        tx.send_layer(h, layer, 0, src[layer, 0, block], src[layer, 1, block])
    tx.finish(h, timeout=30)
    done.result(timeout=30)
    assert torch.equal(cache[:, :, dst_block], src[:, :, src_block])


@pytest.mark.timeout(60)
def test_layers_land_in_the_announced_blocks() -> None:
    geo, cache, rx = _pair()
    src = torch.randn(geo.cache_shape(8))
    tx = create_sender("gloo", geo)
    try:
        spec = TransferSpec.new([5, 1, 6], 0, 2)
        done = rx.expect(spec, timeout=30)
        h = tx.start(rx.endpoint, spec.transfer_id, spec.token, 3)
        for layer in range(geo.num_layers):  # sender blocks 2, 3, 4 -> receiver 5, 1, 6
            tx.send_layer(h, layer, 0, src[layer, 0, 2:5], src[layer, 1, 2:5])
        sent = tx.finish(h, timeout=30)
        got = done.result(timeout=30)
        assert got.bytes == sent.bytes == 3 * 2 * 3 * 4 * 2 * 8 * 4
        assert torch.equal(cache[:, :, [5, 1, 6]], src[:, :, 2:5])
        assert (cache[:, :, [0, 2, 3, 4, 7]] == -1).all()  # nothing else touched
        _send_one_block(tx, rx, cache, src, 7, 0)  # a second transfer reuses the pair
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_unknown_transfer_and_bad_token_are_dropped_and_the_pair_goes_on() -> None:
    geo, cache, rx = _pair()
    src = torch.randn(geo.cache_shape(8))
    tx = create_sender("gloo", geo)
    try:
        stranger = TransferSpec.new([0], 0, 2)  # never announced to the receiver
        h = tx.start(rx.endpoint, stranger.transfer_id, stranger.token, 1)
        tx.send_layer(h, 0, 0, src[0, 0, :1], src[0, 1, :1])
        tx.finish(h, timeout=30)
        spec = TransferSpec.new([3], 0, 2)
        done = rx.expect(spec, timeout=30)
        forged = tx.start(rx.endpoint, spec.transfer_id, b"\x00" * 16, 1)
        tx.send_layer(forged, 0, 0, src[0, 0, :1], src[0, 1, :1])
        tx.finish(forged, timeout=30)
        h = tx.start(rx.endpoint, spec.transfer_id, spec.token, 1)
        for layer in range(geo.num_layers):
            tx.send_layer(h, layer, 0, src[layer, 0, :1], src[layer, 1, :1])
        tx.finish(h, timeout=30)
        done.result(timeout=30)
        stats = rx.stats
        assert stats.dropped_unknown_transfer == 1 and stats.dropped_bad_token == 1
        assert torch.equal(cache[:, :, 3], src[:, :, 0])
        assert (cache[:, :, [0, 1, 2, 4, 5, 6, 7]] == -1).all()
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_heads_are_resplit_across_receivers() -> None:
    src_geo = PageGeometry(num_kv_heads=4, head_start=0, **GEO)
    src = torch.randn(src_geo.cache_shape(8))
    halves = [_pair(heads=2, head_start=h) for h in (0, 2)]
    tx = create_sender("gloo", src_geo)
    try:
        spec = TransferSpec.new([1], 0, 2)
        futures = []
        for geo, _, rx in halves:
            s = TransferSpec(spec.transfer_id, spec.token, (1,), geo.head_start, 2)
            futures.append(rx.expect(s, timeout=30))
            h = tx.start(rx.endpoint, s.transfer_id, s.token, 1, (geo.head_start, 2))
            for layer in range(3):
                tx.send_layer(h, layer, 0, src[layer, 0, 4:5], src[layer, 1, 4:5])
            assert tx.finish(h, timeout=30).bytes == 3 * 2 * 4 * 2 * 8 * 4  # two heads each
        for (geo, cache, _), f in zip(halves, futures, strict=True):
            f.result(timeout=30)
            lo = geo.head_start
            assert torch.equal(cache[:, :, 1], src[:, :, 4, :, lo : lo + 2])
    finally:
        tx.close()
        for _, _, rx in halves:
            rx.close()


@pytest.mark.timeout(60)
def test_no_receiver_is_a_transfer_error() -> None:
    geo = PageGeometry(num_kv_heads=2, head_start=0, **GEO)
    tx = create_sender("gloo", geo)
    spec = TransferSpec.new([0], 0, 2)
    with pytest.raises(TransferError, match="cannot reach"):
        tx.start("tcp://127.0.0.1:1", spec.transfer_id, spec.token, 1)


@pytest.mark.timeout(60)
def test_frames_queued_together_all_land_and_are_counted() -> None:
    """One block per frame, several transfers queued before any finish: the sender posts what
    is queued in batches (one store message, one send each); every frame lands in its block."""
    geo, cache, rx = _pair()
    src = torch.randn(geo.cache_shape(8))
    tx = create_sender("gloo", geo)
    try:
        work = []
        for dest in ([7, 0, 3], [1, 6], [2, 5, 4]):
            spec = TransferSpec.new(dest, 0, 2)
            done = rx.expect(spec, timeout=30)
            h = tx.start(rx.endpoint, spec.transfer_id, spec.token, len(dest))
            for layer in range(geo.num_layers):
                for j in range(len(dest)):
                    tx.send_layer(h, layer, j, src[layer, 0, j : j + 1], src[layer, 1, j : j + 1])
            work.append((dest, h, done))
        for dest, h, done in work:
            assert tx.finish(h, timeout=30).frames == 3 * len(dest)
            done.result(timeout=30)
            assert torch.equal(cache[:, :, dest], src[:, :, : len(dest)])
        assert rx.stats.frames_received == tx.stats.frames_sent == 3 * 8
        assert rx.stats.transfers_completed == 3 and rx.stats.frames_dropped == 0
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_headers_that_do_not_add_up_end_only_that_pair() -> None:
    """A peer that sends bytes other than whole headers on its header channel loses its pair;
    the receiver counts it and goes on serving other senders."""
    from pdmesh.kv_transfer.p2p_pairs import (
        HeaderOutbox,
        announce_pair,
        host_port,
        join_store,
        pair_group,
    )

    geo, cache, rx = _pair()
    store = join_store(rx.endpoint)
    pair_id = announce_pair(store)
    # The receiver joins as rank 1. Held to the end: a collected group closes its sockets, and a
    # receiver still connecting then loses the pair before it reads the header.
    group = pair_group(store, pair_id, rank=0, backend="gloo")
    # Kept open until the receiver has read it: a closed socket drops what it has not sent.
    outbox = HeaderOutbox(store, pair_id, host_port(rx.endpoint)[0])
    outbox.push(b"PDKV" + b"\x00" * 90)
    src = torch.randn(geo.cache_shape(8))
    tx = create_sender("gloo", geo)
    try:
        deadline = time.monotonic() + 20
        while rx.stats.dropped_malformed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.stats.dropped_malformed == 1
        _send_one_block(tx, rx, cache, src, 0, 4)
    finally:
        outbox.close()
        tx.close()
        rx.close()
        del group


_RECEIVER_PROCESS = """
import sys, time, torch
from pdmesh.kv_transfer import PageGeometry, create_receiver
geo = PageGeometry(num_layers=3, block_size=4, num_kv_heads=2, head_start=0, head_dim=8,
                   dtype=torch.float32)
rx = create_receiver("gloo", torch.zeros(geo.cache_shape(8)), geo, "tcp://127.0.0.1:0")
print(rx.endpoint, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(90)
def test_a_killed_receiver_fails_finish_in_time_and_a_new_one_is_served() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER_PROCESS], stdout=subprocess.PIPE, text=True
    )
    geo = PageGeometry(num_kv_heads=2, head_start=0, **GEO)
    src = torch.randn(geo.cache_shape(8))
    tx = create_sender("gloo", geo)
    try:
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        spec = TransferSpec.new([0], 0, 2)  # never announced there: frames would be dropped
        h = tx.start(endpoint, spec.transfer_id, spec.token, 1)  # the pair is made
        child.kill()
        child.wait()
        tx.send_layer(h, 0, 0, src[0, 0, :1], src[0, 1, :1])
        begun = time.monotonic()
        with pytest.raises(TransferError):
            tx.finish(h, timeout=5)
        assert time.monotonic() - begun < 30
        assert tx.stats.transfers_failed == 1
        _, cache, rx = _pair()
        try:
            _send_one_block(tx, rx, cache, src, 5, 2)
        finally:
            rx.close()
    finally:
        child.kill()
        tx.close()


@pytest.mark.timeout(90)
def test_concurrent_transfers_from_two_head_halves_all_complete() -> None:
    """Six transfers at once from threads, each split over two senders (one KV head each, as
    a TP=2 prefill worker sends): batches then hold frames of several transfers, and every
    transfer's finish returns once its sends are done."""
    geo, cache, rx = _pair()
    halves = [PageGeometry(num_kv_heads=1, head_start=h, **GEO) for h in (0, 1)]
    senders = [create_sender("gloo", g) for g in halves]
    src = torch.randn(geo.cache_shape(8))
    errors: list[BaseException] = []

    def one(blocks: list[int]) -> None:
        try:
            spec = TransferSpec.new(blocks, 0, 2)
            done = rx.expect(spec, timeout=30)
            n = len(blocks)
            handles = [tx.start(rx.endpoint, spec.transfer_id, spec.token, n) for tx in senders]
            for layer in range(geo.num_layers):
                for head, (tx, h) in enumerate(zip(senders, handles, strict=True)):
                    kv = src[layer, :, :n, :, head : head + 1]
                    tx.send_layer(h, layer, 0, kv[0], kv[1])
            for tx, h in zip(senders, handles, strict=True):
                tx.finish(h, timeout=30)
            done.result(timeout=30)
        except BaseException as e:
            errors.append(e)

    groups = [[0], [1, 2], [3], [4, 5], [6], [7]]
    threads = [threading.Thread(target=one, args=(g,)) for g in groups]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for g in groups:
            assert torch.equal(cache[:, :, g], src[:, :, : len(g)])
        assert rx.stats.transfers_completed == len(groups)
        assert sum(tx.stats.transfers for tx in senders) == 2 * len(groups)
    finally:
        for tx in senders:
            tx.close()
        rx.close()


def test_consecutive_layers_are_written_with_one_delivery() -> None:
    """The receiver writes a run of frames alike but for their layers in one go; the result
    and the counters are those of the frames one by one, and a run past the last layer is
    refused whole."""
    from pdmesh.kv_transfer.frame import DTYPE_CODES, FrameHeader, Verdict
    from pdmesh.kv_transfer.inbox import TransferInbox

    geo = PageGeometry(num_kv_heads=2, head_start=0, **GEO)
    cache = torch.full(geo.cache_shape(8), -1.0)
    inbox = TransferInbox(cache, geo)
    spec = TransferSpec.new([6, 2], 0, 2)
    done = inbox.expect(spec, timeout=30)
    src = torch.randn(3, 2, 2, 4, 2, 8)  # [layers, k/v, blocks, block_size, heads, dim]

    def header(layer: int) -> bytes:
        nbytes = src[0].numel() * 4
        return FrameHeader(spec.raw_id, spec.token, layer, 0, 2, 0, 2, 4, 8, 1, nbytes).pack()

    assert DTYPE_CODES[torch.float32] == 1
    payload = src[1:].contiguous().view(-1).view(torch.uint8)
    assert inbox.deliver(header(2), payload, layers=2)[0] is Verdict.BAD_SIZE  # layers 2, 3 of 3
    assert inbox.deliver(header(1), payload, layers=2)[0] is Verdict.ACCEPTED
    assert not done.done()
    assert inbox.deliver(header(0), src[0].contiguous().view(-1).view(torch.uint8))[0] is (
        Verdict.ACCEPTED
    )
    assert done.result(timeout=5).frames == 3
    assert torch.equal(cache[:, :, [6, 2]], src)
    assert inbox.stats.frames_received == 3 and inbox.stats.dropped_bad_size == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["gloo", "tcp"])
def test_send_layers_pushes_every_layer_of_blocks_to_each_receivers_heads(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks complete in a cache (a prefix cached on the prefill worker) go every layer at once;
    with gloo two layers per frame here (batches made small), with tcp layer by layer
    (the default). Each of two receivers of one head gets exactly its head of every layer."""
    from pdmesh.kv_transfer import p2p_sender

    geo = PageGeometry(num_kv_heads=2, head_start=0, **GEO)
    layer_bytes = 2 * 3 * 4 * 1 * 8 * 4  # k/v x 3 blocks x block_size x 1 head x dim x fp32
    monkeypatch.setattr(p2p_sender, "BATCH_BYTES", 2 * layer_bytes)
    halves = [PageGeometry(num_kv_heads=1, head_start=h, **GEO) for h in (0, 1)]
    caches = [torch.full(g.cache_shape(8), -1.0) for g in halves]
    receivers = [
        create_receiver(transport, c, g, "tcp://127.0.0.1:0")
        for c, g in zip(caches, halves, strict=True)
    ]
    tx = create_sender(transport, geo)
    src = torch.randn(geo.cache_shape(8))
    try:
        spec = TransferSpec.new([6, 0, 3], 0, 1)
        futures = []
        handles = []
        for head, rx in enumerate(receivers):
            part = dataclasses.replace(spec, head_start=head)
            futures.append(rx.expect(part, timeout=30))
            handles.append(tx.start(rx.endpoint, spec.transfer_id, spec.token, 3, (head, 1)))
        tx.send_layers(handles, 0, src, torch.tensor([5, 1, 2]))
        for h in handles:
            assert tx.finish(h, timeout=30).frames == geo.num_layers
        for head, (cache, done) in enumerate(zip(caches, futures, strict=True)):
            assert done.result(timeout=30).bytes == geo.num_layers * layer_bytes
            got = cache[:, :, [6, 0, 3]]
            assert torch.equal(got, src[:, :, [5, 1, 2], :, head : head + 1])
            assert (cache[:, :, [1, 2, 4, 5, 7]] == -1).all()
        with pytest.raises(ValueError, match="do not fit"):
            tx.send_layers(handles, 0, src[:2], torch.tensor([5]))
    finally:
        tx.close()
        for rx in receivers:
            rx.close()
