"""Prefill and decode with different pipeline layouts: frames name global layers, a sender sends
each receiver only the layers it holds, and a receiver refuses frames of layers it does not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pdmesh.kv_transfer import KVReceiver, KVSender, PageGeometry, TransferSpec
from pdmesh.kv_transfer.frame import Verdict

pytestmark = pytest.mark.timeout(30)

SRC_BLOCKS = torch.tensor([2, 6])
DST_BLOCKS = [3, 8]


def _stage(geometry: Callable[..., PageGeometry], layers: int, start: int) -> PageGeometry:
    return dataclasses.replace(geometry(layers=layers), layer_start=start)


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_one_sender_of_four_layers_feeds_two_stages(
    geometry: Callable[..., PageGeometry], random_cache: Callable[..., torch.Tensor], transport: str
) -> None:
    """A prefill worker without stages feeding a decode worker of two: each stage gets its own
    two layers, each layer crosses once, through `send_layers` (a cached prefix) and
    `send_blocks` (layer by layer) alike."""
    from pdmesh.kv_transfer import create_receiver, create_sender

    src = geometry(layers=4)
    source = random_cache(src, 8)
    stages = [_stage(geometry, 2, s) for s in (0, 2)]
    caches = [torch.zeros(g.cache_shape(12)) for g in stages]
    receivers = [
        create_receiver(transport, c, g, "tcp://127.0.0.1:0")
        for c, g in zip(caches, stages, strict=True)
    ]
    sender = create_sender(transport, src)
    try:
        spec = TransferSpec.new([*DST_BLOCKS, 9, 10], head_start=0, num_heads=2)
        futures = [r.expect(spec, timeout=10) for r in receivers]
        handles = [
            sender.start(r.endpoint, spec.transfer_id, spec.token, 4, None, (g.layer_start, 2))
            for r, g in zip(receivers, stages, strict=True)
        ]
        sender.send_layers(handles, 0, source, SRC_BLOCKS)  # transfer blocks 0, 1
        for layer in range(4):  # transfer blocks 2, 3
            sender.send_blocks(handles, layer, 2, source[layer], SRC_BLOCKS)
        for h in handles:
            sender.finish(h, timeout=10)
        for g, cache, future in zip(stages, caches, futures, strict=True):
            assert future.result(timeout=10).frames == 2 * 2  # its 2 layers, twice
            expected = source[g.layer_start : g.layer_start + 2, :, SRC_BLOCKS]
            assert torch.equal(cache[:, :, DST_BLOCKS], expected)
            assert torch.equal(cache[:, :, [9, 10]], expected)
        per_stage = 2 * 2 * 4 * 4 * 2 * 8 * 4  # layers x K+V x blocks x tokens x heads x dims x 4
        assert sender.stats.bytes_sent == 2 * per_stage  # each layer once
    finally:
        sender.close()
        for r in receivers:
            r.close()


def test_two_stages_fill_one_receiver_of_every_layer(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    full = random_cache(geometry(layers=3), 8)  # what one rank of every layer would hold
    rx = receiver(geometry(layers=3), 12)
    spec = TransferSpec.new(DST_BLOCKS, head_start=0, num_heads=2)
    done = rx.expect(spec, timeout=5)
    # Prefill stage 0 holds layers [0, 2), stage 1 layer 2: caches indexed from their own first.
    for start, stop in ((0, 2), (2, 3)):
        tx = sender(_stage(geometry, stop - start, start))
        handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, 2)
        tx.send_layers([handle], 0, full[start:stop].clone(), SRC_BLOCKS)
        tx.finish(handle, timeout=5)
        if stop < 3:
            assert not done.done()  # layer 2 is still missing
            assert bool((rx.cache[2, :, DST_BLOCKS] == sentinel).all())
    assert done.result(timeout=5).frames == 3
    assert torch.equal(rx.cache[:, :, DST_BLOCKS], full[:, :, SRC_BLOCKS])


def test_a_frame_of_a_layer_the_receiver_does_not_hold_is_refused(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    """A receiver of layers [2, 4) drops frames naming layers 0, 1 or 4 (never writes them)."""
    rx = receiver(_stage(geometry, 2, 2), 12)
    spec = TransferSpec.new(DST_BLOCKS, head_start=0, num_heads=2)
    rx.expect(spec, timeout=5)
    from pdmesh.kv_transfer.base import SendHandle

    payload = random_cache(geometry(layers=1), 2)[0]  # [2, 2 blocks, ...]
    for layer in (0, 1, 4):
        handle = SendHandle("x", spec.transfer_id, spec.token, 2, 0, 2, layer, 1)
        header = handle.header(geometry(layers=5), layer, 0, 2)
        verdict, _ = rx.inbox.deliver(header, payload.flatten().view(torch.uint8))
        assert verdict is Verdict.BAD_SIZE
    assert bool((rx.cache == sentinel).all())
    assert rx.stats.dropped_bad_size == 3
