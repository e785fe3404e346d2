"""The KV data-plane wire format: fixed little-endian structs and raw tensor bytes, nothing else.

A frame is two message parts, [header, payload]:

    header  = magic b"PDKV", version u16, transfer_id 16 raw bytes, token 16 bytes,
              layer u32, first_block u32, num_blocks u32, head_start u32, num_heads u32,
              block_size u32, head_dim u32, dtype code u8, payload_nbytes u64      (75 bytes)
    payload = K bytes then V bytes, each [num_blocks, block_size, num_heads, head_dim] contiguous

`first_block` indexes the transfer's block list (TransferSpec.block_ids), not a cache. The receiver
answers every frame it could parse with one ack naming its verdict, so a sender learns that its
frames were written (or why they were refused). Nothing here is ever unpickled or executed.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, field
from enum import IntEnum

import torch

MAGIC = b"PDKV"
ACK_MAGIC = b"PDKA"
VERSION = 1

# A sender cuts a layer push into frames of at most this many payload bytes and a receiver refuses
# bigger messages (zmq MAXMSGSIZE), so one peer cannot make a receiver buffer unbounded data.
MAX_FRAME_PAYLOAD = 64 << 20

# Codes are part of the wire format: never renumber, only append.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.int8: 6,
    torch.uint8: 7,
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}

_HEADER = struct.Struct("<4sH16s16sIIIIIIIBQ")
_LAYER = struct.Struct("<I")
_LAYER_OFFSET = 4 + 2 + 16 + 16  # magic, version, transfer id, token
_ACK = struct.Struct("<4sH16sBII")
HEADER_NBYTES = _HEADER.size
ACK_NBYTES = _ACK.size
ID_NBYTES = 16
TOKEN_NBYTES = 16


class MalformedFrame(ValueError):
    """Bytes that are not a frame (or ack) of this version: wrong length, magic or version."""


class Verdict(IntEnum):
    """What a receiver did with a frame; carried in acks, and the key of the drop counters."""

    ACCEPTED = 0
    MALFORMED = 1  # not a [header, payload] of this version
    UNKNOWN_TRANSFER = 2  # never announced, or already completed, timed out or cancelled
    BAD_TOKEN = 3
    BAD_SIZE = 4  # well-formed, but does not fit the transfer or the cache (shape, range, length)


def payload_nbytes(
    num_blocks: int, block_size: int, num_heads: int, head_dim: int, itemsize: int
) -> int:
    """K and V of `num_blocks` blocks of `num_heads` heads."""
    return 2 * num_blocks * block_size * num_heads * head_dim * itemsize


@dataclass(frozen=True)
class FrameHeader:
    transfer_id: bytes  # 16 raw bytes; TransferSpec.transfer_id is their hex
    token: bytes = field(repr=False)
    layer: int
    first_block: int  # index into the transfer's block list
    num_blocks: int
    head_start: int  # global KV head of the payload's first head
    num_heads: int
    block_size: int
    head_dim: int
    dtype_code: int
    payload_nbytes: int

    @property
    def dtype(self) -> torch.dtype | None:
        """None for a code this version does not know."""
        return CODE_DTYPES.get(self.dtype_code)

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, *astuple(self))

    def pack_layers(self, count: int) -> list[bytes]:
        """The packed headers of this frame and of the `count - 1` alike but for the layers
        after it (a run of layers queued together), without a dataclass per layer."""
        buf = bytearray(self.pack())
        out = []
        for layer in range(self.layer, self.layer + count):
            _LAYER.pack_into(buf, _LAYER_OFFSET, layer)
            out.append(bytes(buf))
        return out

    @staticmethod
    def unpack(data: bytes | memoryview) -> FrameHeader:
        if len(data) != HEADER_NBYTES:
            raise MalformedFrame(f"frame header is {len(data)} bytes, expected {HEADER_NBYTES}")
        magic, version, *fields = _HEADER.unpack(data)
        if magic != MAGIC:
            raise MalformedFrame(f"frame magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise MalformedFrame(f"frame version {version}, this receiver speaks {VERSION}")
        return FrameHeader(*fields)


_VERSION = struct.Struct("<H")
_SIZE = struct.Struct("<Q")
_SIZE_OFFSET = _HEADER.size - _SIZE.size  # payload_nbytes, the last field


def peek(data: bytes) -> tuple[int, int]:
    """(layer, payload_nbytes) of a packed header, with its length, magic and version checked
    (MalformedFrame otherwise) and nothing else: what a receiver needs to post a batch's recv,
    before it parses the rest."""
    if (
        len(data) != HEADER_NBYTES
        or data[:4] != MAGIC
        or _VERSION.unpack_from(data, 4)[0] != VERSION
    ):
        FrameHeader.unpack(data)  # raises, saying what is wrong
    return _LAYER.unpack_from(data, _LAYER_OFFSET)[0], _SIZE.unpack_from(data, _SIZE_OFFSET)[0]


def alike_but_layer(a: bytes, b: bytes) -> bool:
    """Two packed headers that differ in nothing but their layer field."""
    end = _LAYER_OFFSET + _LAYER.size
    return a[:_LAYER_OFFSET] == b[:_LAYER_OFFSET] and a[end:] == b[end:]


@dataclass(frozen=True)
class Ack:
    """The receiver's answer to one parsed frame, echoing where the frame pointed."""

    transfer_id: bytes
    verdict: Verdict
    layer: int
    first_block: int

    def pack(self) -> bytes:
        return _ACK.pack(
            ACK_MAGIC, VERSION, self.transfer_id, self.verdict, self.layer, self.first_block
        )

    @staticmethod
    def unpack(data: bytes | memoryview) -> Ack:
        if len(data) != ACK_NBYTES:
            raise MalformedFrame(f"ack is {len(data)} bytes, expected {ACK_NBYTES}")
        magic, version, transfer_id, verdict, layer, first_block = _ACK.unpack(data)
        if magic != ACK_MAGIC or version != VERSION:
            raise MalformedFrame(f"ack magic {magic!r} version {version} not understood")
        try:
            return Ack(transfer_id, Verdict(verdict), layer, first_block)
        except ValueError:
            raise MalformedFrame(f"ack verdict {verdict} not understood") from None
