"""Prefill and decode with different TP sizes: frames name their heads, receivers keep theirs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pdmesh.kv_transfer import KVReceiver, KVSender, PageGeometry, TransferSpec

pytestmark = pytest.mark.timeout(30)

SRC_BLOCKS = [2, 6]
DST_BLOCKS = [3, 8]


def _push(sender: KVSender, endpoint: str, spec: TransferSpec, cache: torch.Tensor) -> None:
    handle = sender.start(endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    src = torch.tensor(SRC_BLOCKS)
    for layer in range(cache.shape[0]):
        sender.send_layer(handle, layer, 0, cache[layer, 0, src], cache[layer, 1, src])
    sender.finish(handle, timeout=5)


def test_one_sender_of_four_heads_feeds_two_ranks_of_two(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    # source: [L, 2, blocks, block_size, 4 heads, head_dim] on a TP=1 prefill worker
    p_geo = geometry(heads=4, head_start=0)
    source = random_cache(p_geo, 8)
    ranks = [receiver(geometry(heads=2, head_start=s), 12) for s in (0, 2)]
    # The decode worker's ranks share one transfer id and token; each expects its own heads.
    spec = TransferSpec.new(DST_BLOCKS, head_start=0, num_heads=2)
    specs = [spec, dataclasses.replace(spec, head_start=2)]
    futures = [r.expect(s, timeout=5) for r, s in zip(ranks, specs, strict=True)]

    tx = sender(p_geo)
    for rank, rank_spec in zip(ranks, specs, strict=True):
        _push(tx, rank.endpoint, rank_spec, source)

    for future in futures:
        future.result(timeout=5)
    for rank in ranks:
        heads = slice(rank.geometry.head_start, rank.geometry.head_end)
        expected = source[:, :, SRC_BLOCKS, :, heads]
        assert torch.equal(rank.cache[:, :, DST_BLOCKS], expected)


def test_two_senders_of_two_heads_fill_one_rank_of_four(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    full = random_cache(geometry(heads=4), 8)  # what a TP=1 model would have computed
    rx = receiver(geometry(heads=4), 12)
    spec = TransferSpec.new(DST_BLOCKS, head_start=0, num_heads=4)
    done = rx.expect(spec, timeout=5)

    # Prefill rank 0 holds heads [0, 2) of the same pages.
    _push(sender(geometry(heads=2, head_start=0)), rx.endpoint, spec, full[..., 0:2, :].clone())
    assert not done.done()  # half the heads are still missing
    assert bool((rx.cache[:, :, DST_BLOCKS, :, 2:4] == sentinel).all())

    _push(sender(geometry(heads=2, head_start=2)), rx.endpoint, spec, full[..., 2:4, :].clone())
    assert done.result(timeout=5).frames == 2 * rx.geometry.num_layers
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], full[:, :, SRC_BLOCKS])


def test_overlapping_head_ranges_write_only_the_intersection(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    # Sender heads [1, 3), receiver heads [2, 4): only global head 2 is shared.
    p_geo = geometry(heads=2, head_start=1)
    source = random_cache(p_geo, 8)
    rx = receiver(geometry(heads=2, head_start=2), 12)
    spec = TransferSpec.new(DST_BLOCKS, head_start=2, num_heads=1)
    done = rx.expect(spec, timeout=5)
    _push(sender(p_geo), rx.endpoint, spec, source)
    done.result(timeout=5)
    # receiver local head 0 = global head 2 = sender local head 1
    assert torch.equal(rx.cache[:, :, DST_BLOCKS, :, 0], source[:, :, SRC_BLOCKS, :, 1])
    assert bool((rx.cache[:, :, :, :, 1] == sentinel).all())


def test_sender_ships_only_the_heads_each_receiver_holds() -> None:
    """A 4-head sender feeding receivers of heads [0, 2) and [2, 4) sends each half once."""
    from pdmesh.kv_transfer import create_receiver, create_sender

    geo = dict(num_layers=1, block_size=4, head_dim=8, dtype=torch.float32)
    src = PageGeometry(num_kv_heads=4, head_start=0, **geo)
    halves = [PageGeometry(num_kv_heads=2, head_start=h, **geo) for h in (0, 2)]
    cache = torch.randn(src.cache_shape(3))
    dest_caches = [torch.zeros(g.cache_shape(3)) for g in halves]
    receivers = [
        create_receiver("tcp", c, g, "tcp://127.0.0.1:0")
        for c, g in zip(dest_caches, halves, strict=True)
    ]
    sender = create_sender("tcp", src)
    try:
        spec = TransferSpec.new([1, 2], 0, 2)
        futures, handles = [], []
        for g, rx in zip(halves, receivers, strict=True):
            s = TransferSpec(spec.transfer_id, spec.token, (1, 2), g.head_start, 2)
            futures.append(rx.expect(s, timeout=10))
            handles.append(sender.start(rx.endpoint, s.transfer_id, s.token, 2, (g.head_start, 2)))
        for h in handles:
            sender.send_layer(h, 0, 0, cache[0, 0, :2], cache[0, 1, :2])
        for h in handles:
            sender.finish(h, timeout=10)
        per_half = 2 * 2 * 4 * 2 * 8 * 4  # K+V x blocks x tokens x heads x dims x 4 bytes
        for g, dest, f in zip(halves, dest_caches, futures, strict=True):
            assert f.result(timeout=10).bytes == per_half
            lo = g.head_start
            # Source blocks 0..1 land in destination blocks 1..2, heads lo..lo+2.
            assert torch.equal(dest[0, :, 1:3], cache[0, :, 0:2, :, lo : lo + 2])
        assert sender.stats.bytes_sent == 2 * per_half
    finally:
        sender.close()
        for rx in receivers:
            rx.close()
