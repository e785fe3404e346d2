"""Moving paged KV blocks between workers (docs/architecture.md): transports behind one
sender / receiver interface, and the KV connectors (`connector.py`) through which the engine
meets them. Knows blocks and bytes, never models."""

from pdmesh.kv_transfer import p2p as p2p  # registers the "nccl" and "gloo" transports
from pdmesh.kv_transfer import push_connector as push_connector  # registers PushConnector
from pdmesh.kv_transfer import receive_connector as receive_connector  # and ReceiveConnector
from pdmesh.kv_transfer import tcp as tcp  # registers the "tcp" transport
from pdmesh.kv_transfer.base import (
    KVReceiver,
    KVSender,
    PageGeometry,
    SendHandle,
    TransferError,
    TransferSpec,
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
from pdmesh.kv_transfer.stats import ReceiverStats, SenderStats, TransferStats, total_stats

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
