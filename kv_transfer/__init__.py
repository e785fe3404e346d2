"""Moving paged KV blocks between workers (docs/architecture.md): transports behind one
sender / receiver interface, and the KV connectors (`connector.py`) through which the engine
meets them. Knows blocks and bytes, never models."""

from pdmesh.kv_transfer import p2p as p2p  # registers the "nccl" and "gloo" transports
from pdmesh.kv_transfer import push_connector as push_connector  # registers PushConnector
from pdmesh.kv_transfer import receive_connector as receive_connector  # and ReceiveConnector
from pdmesh.kv_transfer import tcp as tcp  # registers the "tcp" transport
from pdmesh.kv_transfer.base import KVReceiver as KVReceiver
from pdmesh.kv_transfer.base import KVSender as KVSender
from pdmesh.kv_transfer.base import SendHandle as SendHandle
from pdmesh.kv_transfer.base import TransferError as TransferError
from pdmesh.kv_transfer.base import TransferSpec as TransferSpec
from pdmesh.kv_transfer.frame import MAX_FRAME_PAYLOAD as MAX_FRAME_PAYLOAD
from pdmesh.kv_transfer.frame import FrameHeader as FrameHeader
from pdmesh.kv_transfer.frame import Verdict as Verdict
from pdmesh.kv_transfer.geometry import PageGeometry as PageGeometry
from pdmesh.kv_transfer.registry import AUTO as AUTO
from pdmesh.kv_transfer.registry import available_transports as available_transports
from pdmesh.kv_transfer.registry import check_transport as check_transport
from pdmesh.kv_transfer.registry import create_receiver as create_receiver
from pdmesh.kv_transfer.registry import create_sender as create_sender
from pdmesh.kv_transfer.registry import register_transport as register_transport
from pdmesh.kv_transfer.registry import resolve_transport as resolve_transport
from pdmesh.kv_transfer.stats import ReceiverStats as ReceiverStats
from pdmesh.kv_transfer.stats import SenderStats as SenderStats
from pdmesh.kv_transfer.stats import TransferStats as TransferStats
from pdmesh.kv_transfer.stats import total_stats as total_stats
