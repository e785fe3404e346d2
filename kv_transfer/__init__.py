"""Moving paged KV blocks between workers: one interface, several transports (DESIGN.md §6).
Knows blocks and bytes, never models."""

from pdmesh.kv_transfer import p2p as p2p  # registers the "nccl" and "gloo" transports
from pdmesh.kv_transfer import tcp as tcp  # registers the "tcp" transport
from pdmesh.kv_transfer.base import (
    KVReceiver,
    KVSender,
    PageGeometry,
    ReceiverStats,
    SenderStats,
    SendHandle,
    TransferError,
    TransferSpec,
    TransferStats,
    total_stats,
)
from pdmesh.kv_transfer.frame import MAX_FRAME_PAYLOAD, FrameHeader, Verdict
from pdmesh.kv_transfer.registry import (
    AUTO,
    available_transports,
    check_transport,
    create_receiver,
    create_sender,
    register_transport,
    resolve_transport,
)

__all__ = [
    "AUTO",
    "MAX_FRAME_PAYLOAD",
    "FrameHeader",
    "KVReceiver",
    "KVSender",
    "PageGeometry",
    "ReceiverStats",
    "SendHandle",
    "SenderStats",
    "TransferError",
    "TransferSpec",
    "TransferStats",
    "Verdict",
    "available_transports",
    "check_transport",
    "create_receiver",
    "create_sender",
    "register_transport",
    "resolve_transport",
    "total_stats",
]
