"""The process-group transport (`gloo` here; `nccl` is the same code on GPUs): real groups."""

from __future__ import annotations

import pytest
import torch

from pdmesh.kv_transfer import (
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
        # A second transfer reuses the pair.
        spec2 = TransferSpec.new([0], 0, 2)
        done2 = rx.expect(spec2, timeout=30)
        h2 = tx.start(rx.endpoint, spec2.transfer_id, spec2.token, 1)
        for layer in range(geo.num_layers):
            tx.send_layer(h2, layer, 0, src[layer, 0, 7:8], src[layer, 1, 7:8])
        tx.finish(h2, timeout=30)
        done2.result(timeout=30)
        assert torch.equal(cache[:, :, 0], src[:, :, 7])
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
