"""fp8 KV pages over the tcp transport: moved as bytes, bit for bit, and a push of another dtype
refused with a reason a user can act on (not a silent reinterpretation of the bytes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kv_transfer import KVReceiver, KVSender, PageGeometry, TransferError, TransferSpec

pytestmark = pytest.mark.timeout(30)

FP8 = torch.float8_e4m3fn
SRC_BLOCKS = [6, 2, 3]
DST_BLOCKS = [1, 8, 4]


def _push(tx: KVSender, rx: KVReceiver, spec: TransferSpec, source: torch.Tensor) -> None:
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    src = torch.tensor(SRC_BLOCKS)
    for layer in range(source.shape[0]):
        # k, v: [n, block_size, heads, head_dim], gathered from the sender's pages
        tx.send_layer(handle, layer, 0, source[layer, 0, src], source[layer, 1, src])
    tx.finish(handle, timeout=5)


def test_fp8_pages_arrive_bit_for_bit(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
) -> None:
    geo = geometry(heads=2, dtype=FP8)
    g = torch.Generator().manual_seed(0)
    # Every one of the 256 byte patterns, NaN codes included: nothing on the way may convert.
    source = torch.randint(0, 256, geo.cache_shape(8), generator=g, dtype=torch.uint8).view(FP8)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, geo.head_start, geo.num_kv_heads)
    done = rx.expect(spec, timeout=5)
    # send_layers gathers the blocks from the cache itself, as a prefill worker, a migration
    # and the KV store push them.
    tx = sender(geo)
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    tx.send_layers([handle], 0, source, torch.tensor(SRC_BLOCKS))
    tx.finish(handle, timeout=5)
    got = done.result(timeout=5)
    assert got.bytes == geo.num_layers * len(SRC_BLOCKS) * geo.bytes_per_block
    assert geo.bytes_per_block == 2 * geo.num_kv_heads * geo.block_size * geo.head_dim  # 1 byte
    received = rx.cache[:, :, DST_BLOCKS].view(torch.uint8)
    assert torch.equal(received, source[:, :, SRC_BLOCKS].view(torch.uint8))


@pytest.mark.parametrize(("sent", "held"), [(torch.bfloat16, FP8), (FP8, torch.float32)])
def test_a_push_of_another_kv_dtype_fails_saying_why(
    sent: torch.dtype,
    held: torch.dtype,
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
) -> None:
    """A prefill worker and a decode worker started with different kv_cache_dtype: the push is
    refused, no block is written, and the decode side's transfer fails naming both dtypes."""
    tx_geo, rx_geo = geometry(heads=2, dtype=sent), geometry(heads=2, dtype=held)
    rx = receiver(rx_geo, 12)
    before = rx.cache.clone()
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=1)
    source = torch.randn(tx_geo.cache_shape(8)).to(sent)
    with pytest.raises(TransferError):
        _push(sender(tx_geo), rx, spec, source)
    with pytest.raises(TransferError, match="same kv_cache_dtype") as failed:
        done.result(timeout=5)
    for dtype in (sent, held):
        assert str(dtype).removeprefix("torch.") in str(failed.value)
    assert torch.equal(rx.cache.view(torch.uint8), before.view(torch.uint8))
    assert rx.stats.transfers_failed == 1
