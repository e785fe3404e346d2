"""Transport `tcp`: pyzmq over TCP, zero-copy multipart frames; works on CPU and across hosts.

Receiver (tcp_receiver.py): one ROUTER socket bound at `bind`, one daemon thread that checks and
writes frames and acks each one. Sender (tcp_sender.py): one DEALER socket per receiver endpoint,
reused across transfers, driven by one daemon thread fed by a queue, so `send_layer` never waits on
the network. Thanks to the acks, a successful `finish` means "written into the receiver's cache".
"""

from __future__ import annotations

from pdmesh.kv_transfer.registry import register_transport
from pdmesh.kv_transfer.tcp_receiver import TcpReceiver
from pdmesh.kv_transfer.tcp_sender import TcpSender


@register_transport("tcp")
class TcpTransport:
    receiver = TcpReceiver
    sender = TcpSender
