"""Transports `nccl` and `gloo`: KV frames over a two-rank process group per (sender, receiver)
pair. `nccl` moves GPU pages device to device (NCCL p2p, no host staging); `gloo` is the same
protocol between CPU caches (CPU-only hosts, and the tests). See p2p_pairs.py for the
rendezvous, p2p_receiver.py / p2p_sender.py for the two ends (p2p_poster.py: the sending
side's thread per pair)."""

from __future__ import annotations

from pdmesh.kv_transfer.p2p_receiver import P2PReceiver
from pdmesh.kv_transfer.p2p_sender import P2PSender
from pdmesh.kv_transfer.registry import register_transport


@register_transport("gloo")
class GlooTransport:
    receiver = P2PReceiver
    sender = P2PSender
    devices = ("cpu",)


class NcclReceiver(P2PReceiver):
    backend = "nccl"


class NcclSender(P2PSender):
    backend = "nccl"


@register_transport("nccl")
class NcclTransport:
    receiver = NcclReceiver
    sender = NcclSender
    devices = ("cuda",)
