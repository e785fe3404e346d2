"""Value types and the wire format: what a bad config or bad bytes turn into."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdmesh.kv_transfer import FrameHeader, PageGeometry, TransferSpec
from pdmesh.kv_transfer.frame import HEADER_NBYTES, MalformedFrame


def test_geometry_rejects_what_cannot_be_transferred() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        PageGeometry(2, 16, 0, 0, 64, torch.float16)
    with pytest.raises(ValueError, match="head_start"):
        PageGeometry(2, 16, 4, -1, 64, torch.float16)
    with pytest.raises(ValueError, match="supported: float32"):
        PageGeometry(2, 16, 4, 0, 64, torch.int64)


def test_geometry_sizes_and_cache_check() -> None:
    g = PageGeometry(
        num_layers=2, block_size=16, num_kv_heads=4, head_start=4, head_dim=64, dtype=torch.bfloat16
    )
    assert g.head_end == 8
    assert g.bytes_per_block_per_head == 16 * 64 * 2
    assert g.bytes_per_block == 2 * 4 * 16 * 64 * 2
    assert g.check_cache(torch.zeros(g.cache_shape(10), dtype=torch.bfloat16)) == 10
    with pytest.raises(ValueError, match=r"is not \[2, 2, num_blocks, 16, 4, 64\]"):
        g.check_cache(torch.zeros((2, 2, 10, 16, 2, 64), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        g.check_cache(torch.zeros(g.cache_shape(10), dtype=torch.float32))


def test_new_spec_is_random_and_keeps_its_token_out_of_logs() -> None:
    a = TransferSpec.new([3, 1, 2], head_start=0, num_heads=4)
    b = TransferSpec.new([3, 1, 2], head_start=0, num_heads=4)
    assert len(a.transfer_id) == 32 and int(a.transfer_id, 16) >= 0
    assert len(a.token) == 16
    assert (a.transfer_id, a.token) != (b.transfer_id, b.token)
    assert a.block_ids == (3, 1, 2) and a.raw_id == bytes.fromhex(a.transfer_id)
    assert a.token.hex() not in repr(a) and repr(a.token) not in repr(a)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"transfer_id": "ABC"}, "32 lowercase hex"),
        ({"token": b"short"}, "16 bytes"),
        ({"block_ids": ()}, "at least one block"),
        ({"block_ids": (1, 2, 1)}, "repeats a block"),
        ({"block_ids": (-1,)}, "block_ids"),
        ({"num_heads": 0}, "num_heads"),
    ],
)
def test_spec_rejects_bad_fields(change: dict[str, object], message: str) -> None:
    spec = TransferSpec.new([0, 1], head_start=0, num_heads=2)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(spec, **change)


def _header() -> FrameHeader:
    return FrameHeader(
        transfer_id=bytes(range(16)),
        token=b"t" * 16,
        layer=3,
        first_block=5,
        num_blocks=2,
        head_start=4,
        num_heads=2,
        block_size=16,
        head_dim=64,
        dtype_code=3,
        payload_nbytes=2 * 2 * 16 * 2 * 64 * 2,
    )


def test_frame_header_round_trips_at_a_fixed_size() -> None:
    packed = _header().pack()
    assert len(packed) == HEADER_NBYTES == 75
    assert packed[:4] == b"PDKV"
    assert FrameHeader.unpack(packed) == _header()
    assert FrameHeader.unpack(packed).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b + b"\0",
        lambda b: b"XXXX" + b[4:],  # magic
        lambda b: b[:4] + b"\x09\x00" + b[6:],  # version 9
    ],
)
def test_frame_header_refuses_foreign_bytes(mangle: object) -> None:
    with pytest.raises(MalformedFrame):
        FrameHeader.unpack(mangle(_header().pack()))  # type: ignore[operator]
