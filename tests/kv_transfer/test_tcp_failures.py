"""Deadlines, cancellation and vanished peers: every wait ends; a dead transfer writes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from pdmesh.kv_transfer import (
    KVReceiver,
    KVSender,
    PageGeometry,
    TransferError,
    TransferSpec,
    create_receiver,
)
from pdmesh.processes import free_port

pytestmark = pytest.mark.timeout(30)

DST_BLOCKS = [3, 8]


def _push(sender: KVSender, endpoint: str, spec: TransferSpec, cache: torch.Tensor) -> None:
    handle = sender.start(endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    for layer in range(cache.shape[0]):
        sender.send_layer(handle, layer, 0, cache[layer, 0, :2], cache[layer, 1, :2])
    sender.finish(handle, timeout=5)


def test_an_expected_transfer_times_out_and_late_frames_are_dropped(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    geo = geometry(heads=2)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    started = time.monotonic()
    done = rx.expect(spec, timeout=0.3)
    with pytest.raises(TransferError, match="timed out"):
        done.result(timeout=3)
    assert 0.3 <= time.monotonic() - started < 1.5
    assert rx.stats.transfers_failed == 1

    with pytest.raises(TransferError, match="unknown_transfer"):
        _push(sender(geo), rx.endpoint, spec, random_cache(geo, 8))
    assert rx.stats.dropped_unknown_transfer >= 1
    assert bool((rx.cache == sentinel).all())


def test_cancel_fails_the_future_and_forgets_the_transfer(
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
    rx.cancel(spec.transfer_id)
    with pytest.raises(TransferError, match="cancelled"):
        done.result(timeout=1)
    rx.cancel(spec.transfer_id)  # idempotent
    with pytest.raises(TransferError, match="unknown_transfer"):
        _push(sender(geo), rx.endpoint, spec, random_cache(geo, 8))
    assert bool((rx.cache == sentinel).all())
    assert rx.stats.transfers_failed == 1


def test_cancelling_the_future_itself_forgets_the_transfer(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    sentinel: float,
) -> None:
    """asyncio.wrap_future cancels the concurrent future when its awaiter is cancelled."""
    geo = geometry(heads=2)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    assert rx.expect(spec, timeout=10).cancel()
    with pytest.raises(TransferError, match="unknown_transfer"):
        _push(sender(geo), rx.endpoint, spec, random_cache(geo, 8))
    assert bool((rx.cache == sentinel).all())
    rx.expect(spec, timeout=10)  # the id is free again


def test_finish_fails_in_time_when_nobody_listens(
    geometry: Callable[..., PageGeometry],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    geo = geometry(heads=2)
    source = random_cache(geo, 8)
    tx = sender(geo)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    handle = tx.start(f"tcp://127.0.0.1:{free_port()}", spec.transfer_id, spec.token, 2)
    for layer in range(geo.num_layers):
        tx.send_layer(handle, layer, 0, source[layer, 0, :2], source[layer, 1, :2])
    started = time.monotonic()
    with pytest.raises(TransferError, match="0 of 3 frames acknowledged"):
        tx.finish(handle, timeout=0.5)
    assert time.monotonic() - started < 1.5
    assert tx.stats.frames_sent == 0  # nothing was queued towards a peer that is not there


def test_finish_fails_when_the_receiver_goes_away_mid_transfer(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
    eventually: Callable[[Callable[[], bool]], None],
) -> None:
    geo = geometry(heads=2)
    source = random_cache(geo, 8)
    rx = receiver(geo, 12)
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    done = rx.expect(spec, timeout=10)
    tx = sender(geo)
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    tx.send_layer(handle, 0, 0, source[0, 0, :2], source[0, 1, :2])
    eventually(lambda: rx.stats.frames_received == 1)

    started = time.monotonic()
    rx.close()
    assert time.monotonic() - started < 1.0
    with pytest.raises(TransferError, match="closed"):
        done.result(timeout=1)
    with pytest.raises(TransferError, match="closed"):
        rx.expect(TransferSpec.new([0], 0, 2), timeout=1)

    tx.send_layer(handle, 1, 0, source[1, 0, :2], source[1, 1, :2])
    with pytest.raises(TransferError, match="1 of 2 frames acknowledged"):
        tx.finish(handle, timeout=0.5)


def test_a_sender_recovers_when_its_receiver_comes_back(
    geometry: Callable[..., PageGeometry],
    sender: Callable[[PageGeometry], KVSender],
    random_cache: Callable[..., torch.Tensor],
) -> None:
    """The cached socket reconnects by itself; a late receiver still gets the frames."""
    geo = geometry(heads=2)
    source = random_cache(geo, 8)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    spec = TransferSpec.new(DST_BLOCKS, 0, 2)
    tx = sender(geo)
    handle = tx.start(endpoint, spec.transfer_id, spec.token, spec.num_blocks)
    for layer in range(geo.num_layers):
        tx.send_layer(handle, layer, 0, source[layer, 0, :2], source[layer, 1, :2])
    time.sleep(0.2)  # the sender retries connecting meanwhile
    cache = torch.zeros(geo.cache_shape(12))
    with create_receiver("tcp", cache, geo, endpoint) as rx:
        done = rx.expect(spec, timeout=5)
        assert tx.finish(handle, timeout=5).frames == geo.num_layers
        done.result(timeout=5)
    assert torch.equal(cache[:, :, DST_BLOCKS], source[:, :, :2])


def test_bad_arguments_are_value_errors(
    geometry: Callable[..., PageGeometry],
    receiver: Callable[..., KVReceiver],
    sender: Callable[[PageGeometry], KVSender],
) -> None:
    geo = geometry(heads=2, head_start=2)
    rx = receiver(geo, 12)
    with pytest.raises(ValueError, match="names block 12"):
        rx.expect(TransferSpec.new([0, 12], 2, 2), timeout=1)
    with pytest.raises(ValueError, match=r"this rank holds \[2, 4\)"):
        rx.expect(TransferSpec.new([0], 0, 2), timeout=1)
    with pytest.raises(ValueError, match="positive"):
        rx.expect(TransferSpec.new([0], 2, 2), timeout=0)
    spec = TransferSpec.new([0, 1], 2, 2)
    rx.expect(spec, timeout=5)
    with pytest.raises(ValueError, match="already expected"):
        rx.expect(spec, timeout=5)

    tx = sender(geo)
    with pytest.raises(ValueError, match="tcp://"):
        tx.start("localhost:1234", spec.transfer_id, spec.token, 2)
    handle = tx.start(rx.endpoint, spec.transfer_id, spec.token, 2)
    with pytest.raises(ValueError, match="already open"):
        tx.start(rx.endpoint, spec.transfer_id, spec.token, 2)
    k = torch.zeros(2, geo.block_size, geo.num_kv_heads, geo.head_dim)
    with pytest.raises(ValueError, match="is not"):
        tx.send_layer(handle, 0, 0, k[:, :, :1], k[:, :, :1])
    with pytest.raises(ValueError, match="dtype"):
        tx.send_layer(handle, 0, 0, k.double(), k.double())
    with pytest.raises(ValueError, match="layer 3"):
        tx.send_layer(handle, 3, 0, k, k)
    with pytest.raises(ValueError, match=r"blocks \[1, 3\)"):
        tx.send_layer(handle, 0, 1, k, k)
    tx.abort(handle)
    with pytest.raises(ValueError, match="after finish"):
        tx.send_layer(handle, 0, 0, k, k)
