"""Pages pushed layer by layer over real loopback sockets land in the right receiver blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import torch

from pdmesh.kv_transfer import KVReceiver, KVSender, PageGeometry, TransferSpec
from pdmesh.kv_transfer.tcp import TcpSender

pytestmark = pytest.mark.timeout(30)

# Sender block ids -> receiver block ids: neither side contiguous, order preserved.
SRC_BLOCKS = [7, 1, 4]
DST_BLOCKS = [5, 0, 9]


def _push_all_layers(
    sender: KVSender, endpoint: str, spec: TransferSpec, cache: torch.Tensor
) -> None:
    handle = sender.start(endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    src = torch.tensor(SRC_BLOCKS)
    for layer in range(cache.shape[0]):
        # k, v: [n, block_size, heads, head_dim], gathered from the sender's pages
        sender.send_layer(handle, layer, 0, cache[layer, 0, src], cache[layer, 1, src])
    sender.finish(handle, timeout=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_writes_exactly_the_announced_blocks(
    dtype: torch.dtype,
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    geo = geometry(heads=2, dtype=dtype)
    source = random_cache(geo, 8)
    rx = receiver(geo, 12)
    tx = sender(geo)
    spec = TransferSpec.new(DST_BLOCKS, geo.head_start, geo.num_kv_heads)
    done = rx.expect(spec, timeout=5)

    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    src = torch.tensor(SRC_BLOCKS)
    for layer in range(geo.num_layers):
        tx.send_layer(handle, layer, 0, source[layer, 0, src], source[layer, 1, src])
    sent = tx.finish(handle, timeout=5)
    got = done.result(timeout=5)

    expected_bytes = geo.num_layers * len(SRC_BLOCKS) * geo.bytes_per_block
    assert got.bytes == sent.bytes == expected_bytes
    assert got.frames == sent.frames == geo.num_layers
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, SRC_BLOCKS])
    untouched = [b for b in range(12) if b not in DST_BLOCKS]
    assert bool((rx.cache[:, :, untouched] == sentinel).all())
    assert rx.stats.transfers_completed == 1 and rx.stats.bytes_received == expected_bytes
    assert tx.stats.transfers == 1 and tx.stats.bytes_sent == expected_bytes


def test_large_pushes_are_cut_into_bounded_frames(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    geo = geometry(heads=2)
    source = random_cache(geo, 8)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=5)
    # Room for two blocks per frame: 3 blocks per layer -> 2 frames per layer.
    with TcpSender(geo, max_frame_bytes=2 * geo.bytes_per_block) as tx:
        _push_all_layers(tx, rx.endpoint, spec, source)
    assert done.result(timeout=5).frames == 2 * geo.num_layers
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, SRC_BLOCKS])


def test_layers_flow_while_the_sender_still_computes(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    eventually: Callable[[Callable[[], bool]], None],
) -> None:
    geo = geometry(heads=2, layers=4)
    source = random_cache(geo, 8)
    rx, tx = receiver(geo, 12), sender(geo)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=5)
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    src = torch.tensor(SRC_BLOCKS)
    for layer in range(geo.num_layers):
        started = time.perf_counter()
        tx.send_layer(handle, layer, 0, source[layer, 0, src], source[layer, 1, src])
        assert time.perf_counter() - started < 0.5  # queued, not sent inline
        # "Compute" the next layer; this layer must reach the receiver meanwhile.
        eventually(lambda n=layer + 1: rx.stats.frames_received == n)
        assert not done.done() or layer == geo.num_layers - 1
        time.sleep(0.02)
    stats = tx.finish(handle, timeout=5)
    assert stats.frames == geo.num_layers and stats.seconds > 0.02 * (geo.num_layers - 1)
    assert done.result(timeout=5).frames == geo.num_layers
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, SRC_BLOCKS])


def test_blocks_may_arrive_in_pieces_and_out_of_order(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    """Chunked prefill pushes a layer's blocks as chunks finish, not all at once."""
    geo = geometry(heads=2, layers=2)
    source = random_cache(geo, 8)
    rx, tx = receiver(geo, 12), sender(geo)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=5)
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    for layer in reversed(range(geo.num_layers)):
        for j in (2, 0, 1):
            block = SRC_BLOCKS[j]
            k, v = source[layer, 0, block : block + 1], source[layer, 1, block : block + 1]
            tx.send_layer(handle, layer, j, k, v)
    assert tx.finish(handle, timeout=5).frames == 6
    assert done.result(timeout=5).frames == 6
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, SRC_BLOCKS])


def test_concurrent_transfers_from_several_threads(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    geo = geometry(heads=2)
    rx, tx = receiver(geo, 16), sender(geo)
    sources = [random_cache(geo, 8, seed=i) for i in range(4)]
    specs = [TransferSpec.new([4 * i + j for j in range(3)], 0, 2) for i in range(4)]
    futures = [rx.expect(spec, timeout=5) for spec in specs]
    errors: list[BaseException] = []

    def push(i: int) -> None:
        try:
            _push_all_layers(tx, rx.endpoint, specs[i], sources[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=push, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not errors
    for spec, source, future in zip(specs, sources, futures, strict=True):
        future.result(timeout=5)
        assert torch.equal(rx.cache[:, :, list(spec.block_ids)], source[:, :, SRC_BLOCKS])
    assert tx.stats.transfers == 4


def test_futures_can_be_awaited_from_asyncio(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    """How the decode service waits: the receiver thread settles, the event loop awaits."""
    geo = geometry(heads=2)
    source = random_cache(geo, 8)
    rx, tx = receiver(geo, 12), sender(geo)

    async def decode_side() -> int:
        spec = TransferSpec.new(DST_BLOCKS, 0, 2)
        arrived = asyncio.wrap_future(rx.expect(spec, timeout=5))
        loop = asyncio.get_running_loop()
        pushed = loop.run_in_executor(None, _push_all_layers, tx, rx.endpoint, spec, source)
        stats, _ = await asyncio.gather(arrived, pushed)
        return stats.frames

    assert asyncio.run(decode_side()) == geo.num_layers
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], source[:, :, SRC_BLOCKS])
