"""KV transports by name (docs/architecture.md): services pick one from config.

A transport registers a class that names its pair, and the caches it can move (default: CPU
and GPU):

    @register_transport("tcp")
    class TcpTransport:
        receiver = TcpReceiver
        sender = TcpSender

`auto` is not a transport but a choice made from the cache's device (`resolve_transport`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from pdmesh.kv_transfer.base import KVReceiver, KVSender
from pdmesh.kv_transfer.geometry import PageGeometry

T = TypeVar("T", bound=type)

_TRANSPORTS: dict[str, tuple[type[KVReceiver], type[KVSender]]] = {}
_DEVICES: dict[str, tuple[str, ...]] = {}  # transport -> device types of the caches it moves
AUTO = "auto"


def register_transport(name: str) -> Callable[[T], T]:
    def register(holder: T) -> T:
        receiver = getattr(holder, "receiver", None)
        sender = getattr(holder, "sender", None)
        if not (isinstance(receiver, type) and issubclass(receiver, KVReceiver)):
            raise TypeError(f"transport {name!r}: {holder.__name__}.receiver is not a KVReceiver")
        if not (isinstance(sender, type) and issubclass(sender, KVSender)):
            raise TypeError(f"transport {name!r}: {holder.__name__}.sender is not a KVSender")
        if name in _TRANSPORTS:
            raise ValueError(f"KV transport {name!r} is registered twice")
        _TRANSPORTS[name] = (receiver, sender)
        _DEVICES[name] = tuple(getattr(holder, "devices", ("cpu", "cuda")))
        return holder

    return register


def available_transports() -> tuple[str, ...]:
    return tuple(sorted(_TRANSPORTS))


def _lookup(name: str) -> tuple[type[KVReceiver], type[KVSender]]:
    try:
        return _TRANSPORTS[name]
    except KeyError:
        valid = ", ".join(available_transports())
        raise ValueError(f"unknown KV transport {name!r}; available: {valid}") from None


def check_transport(name: str, device: torch.device) -> None:
    """ValueError (a sentence) unless transport `name` exists and moves caches on `device`."""
    _lookup(name)  # an unknown name: ValueError listing the known ones
    devices = _DEVICES[name]
    if device.type not in devices:
        raise ValueError(
            f"the {name} KV transport moves caches on {' or '.join(devices)}; this worker's "
            f"cache is on {device.type}."
        )


def resolve_transport(name: str, device: torch.device) -> str:
    """`name`, checked against the cache's device; `auto` picks nccl for a GPU cache (device to
    device, on one host or across hosts) and tcp for a CPU one."""
    if name == AUTO:
        name = "nccl" if device.type == "cuda" else "tcp"
    check_transport(name, device)
    return name


def create_receiver(
    name: str, cache: torch.Tensor, geometry: PageGeometry, bind: str
) -> KVReceiver:
    return _lookup(name)[0](cache, geometry, bind)


def create_sender(name: str, geometry: PageGeometry) -> KVSender:
    return _lookup(name)[1](geometry)
