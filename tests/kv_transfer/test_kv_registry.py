"""Transports are picked by name from config."""

from __future__ import annotations

import re

import pytest
import torch

from pdmesh.kv_transfer import (
    KVReceiver,
    KVSender,
    PageGeometry,
    available_transports,
    check_transport,
    create_receiver,
    create_sender,
    register_transport,
    resolve_transport,
)
from pdmesh.kv_transfer.tcp import TcpReceiver, TcpSender

GEOMETRY = PageGeometry(2, 4, 2, 0, 8, torch.float32)


def test_tcp_is_available_and_builds_a_working_pair() -> None:
    assert "tcp" in available_transports()
    cache = torch.zeros(GEOMETRY.cache_shape(4))
    with create_receiver("tcp", cache, GEOMETRY, "tcp://127.0.0.1:0") as receiver:
        assert isinstance(receiver, KVReceiver)
        assert receiver.endpoint.startswith("tcp://127.0.0.1:")
        assert not receiver.endpoint.endswith(":0")
    with create_sender("tcp", GEOMETRY) as sender:
        assert isinstance(sender, KVSender)


def test_unknown_transport_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KV transport 'rdma'; available: .*tcp"):
        create_sender("rdma", GEOMETRY)
    with pytest.raises(ValueError, match="tcp"):
        create_receiver("rdma", torch.zeros(GEOMETRY.cache_shape(4)), GEOMETRY, "tcp://x:1")


def test_a_name_is_registered_once() -> None:
    class Again:
        receiver = TcpReceiver
        sender = TcpSender

    with pytest.raises(ValueError, match="registered twice"):
        register_transport("tcp")(Again)


def test_a_transport_must_name_its_pair() -> None:
    class Half:
        receiver = TcpReceiver

    with pytest.raises(TypeError, match="sender"):
        register_transport("half")(Half)
    assert "half" not in available_transports()


def test_bad_bind_address_is_a_clear_error() -> None:
    cache = torch.zeros(GEOMETRY.cache_shape(4))
    with pytest.raises(ValueError, match=re.escape("tcp://127.0.0.1:5555")):
        create_receiver("tcp", cache, GEOMETRY, "127.0.0.1:5555")
    with pytest.raises(ValueError, match="cannot bind"):
        create_receiver("tcp", cache, GEOMETRY, "tcp://192.0.2.1:0")  # not our address


def test_auto_and_device_checks_pick_a_transport_per_cache() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert resolve_transport("auto", cpu) == "tcp"
    assert resolve_transport("auto", gpu) == "nccl"
    assert resolve_transport("gloo", cpu) == "gloo"
    assert resolve_transport("tcp", gpu) == "tcp"  # staged through host memory, any host
    with pytest.raises(ValueError, match="the nccl KV transport moves caches on cuda; this "):
        check_transport("nccl", cpu)
    with pytest.raises(ValueError, match="the gloo KV transport moves caches on cpu"):
        check_transport("gloo", gpu)
    with pytest.raises(ValueError, match="unknown KV transport 'auto'"):
        check_transport("auto", cpu)  # a choice, resolved first; never a transport
