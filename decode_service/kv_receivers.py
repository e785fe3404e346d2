"""A decode worker's KV receivers: one per tensor-parallel rank and transport in use, each holding
its rank's KV heads. The transport is chosen per pair: `kv_transport_for` names it for a prefill
worker, `kv_transport` for the rest.

Rank 0's receiver lives here; the other ranks' live in their rank extension and are driven by
control operations, which run on the engine thread (methods marked so) because they are
collectives over the worker's process group.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from pdmesh.decode_service.config import DecodeConfig
from pdmesh.decode_service.prefill_client import KVDestination
from pdmesh.engine.kv_layout import kv_heads
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.kv_transfer import (
    KVReceiver,
    PageGeometry,
    ReceiverStats,
    TransferError,
    TransferSpec,
    TransferStats,
    create_receiver,
    resolve_transport,
    total_stats,
)

RANK_EXTENSION = "pdmesh.decode_service.rank_extension:DecodeRankExtension"


def rank_geometry(runner: ModelRunner) -> PageGeometry:
    heads = kv_heads(runner)
    spec = runner.kv_spec
    return PageGeometry(
        num_layers=spec.num_layers,
        block_size=spec.block_size,
        num_kv_heads=heads.count,
        head_start=heads.start,
        head_dim=spec.head_dim,
        dtype=spec.dtype,
    )


def split_advertise(advertise: str) -> tuple[str, int | None]:
    """HOST or HOST:PORT (an IPv6 host in brackets) -> (host, port or None)."""
    host, sep, port = advertise.rpartition(":")
    if sep and port.isdigit() and (":" not in host or host.endswith("]")):
        return host, int(port)
    return advertise, None


def advertised(endpoint: str, advertise: str | None) -> str:
    """The endpoint prefill workers are told to push to: the bound one, with its host replaced
    by `advertise` (HOST), or host and port replaced (HOST:PORT, e.g. behind a port mapping)."""
    if advertise is None:
        return endpoint
    host, port = split_advertise(advertise)
    return f"tcp://{host}:{port if port is not None else endpoint.rsplit(':', 1)[1]}"


def extension_options(config: DecodeConfig) -> dict[str, object]:
    return {
        "transports": wanted_transports(config),
        "bind": config.kv_bind,
        # Every other rank binds a port of its own: only the host is shared.
        "advertise": split_advertise(config.kv_advertise)[0] if config.kv_advertise else None,
    }


def wanted_transports(config: DecodeConfig) -> list[str]:
    """The transports this worker's pairs use, as configured: the default one first."""
    return [config.kv_transport, *config.kv_transport_for.values()]


def open_receivers(
    names: list[str], cache: torch.Tensor, geometry: PageGeometry, bind: str
) -> dict[str, KVReceiver]:
    """One receiver per transport (`auto` resolved for the cache's device), the first bound at
    `bind`, the others at a free port of its host."""
    receivers: dict[str, KVReceiver] = {}
    try:
        for name in dict.fromkeys(resolve_transport(n, cache.device) for n in names):
            at = bind if not receivers else f"{bind.rsplit(':', 1)[0]}:0"
            receivers[name] = create_receiver(name, cache, geometry, at)
    except BaseException:
        for r in receivers.values():
            r.close()
        raise
    return receivers


def receiver_addresses(receivers: dict[str, KVReceiver], advertise: str | None) -> dict[str, str]:
    """What prefill workers push to, per transport: a HOST:PORT advertise is the first (default)
    receiver's port mapping, the others keep their ports."""
    host = split_advertise(advertise)[0] if advertise else None
    return {
        name: advertised(r.endpoint, advertise if i == 0 else host)
        for i, (name, r) in enumerate(receivers.items())
    }


class KVReceivers:
    """Rank 0's receivers (one per transport in use) and the addresses of every rank's."""

    def __init__(self, engine: LLMEngine, config: DecodeConfig) -> None:
        self.engine = engine
        self.geometry = rank_geometry(engine.runner)
        device = engine.runner.kv_cache.data.device
        self.default = resolve_transport(config.kv_transport, device)
        self.per_pair = {
            address: resolve_transport(name, device)
            for address, name in config.kv_transport_for.items()
        }
        self.receivers = open_receivers(
            wanted_transports(config), engine.runner.kv_cache.data, self.geometry, config.kv_bind
        )
        self.addresses = receiver_addresses(self.receivers, config.kv_advertise)
        g = self.geometry
        self.destinations = {
            name: [KVDestination(address, g.head_start, g.num_kv_heads)]
            for name, address in self.addresses.items()
        }
        self.followers = engine.tp_driver is not None
        if engine.tp_driver is not None:  # before the engine thread starts: safe to call here
            for reply in engine.tp_driver.control("kv.endpoint", {}):
                for name, address in reply["addresses"].items():
                    self.destinations[name].append(
                        KVDestination(address, reply["head_start"], reply["num_heads"])
                    )

    def transport_for(self, prefill_address: str) -> str:
        return self.per_pair.get(prefill_address, self.default)

    def expect(
        self, transport: str, block_ids: list[int], timeout_s: float
    ) -> tuple[TransferSpec, Future[TransferStats]]:
        spec = TransferSpec.new(block_ids, self.geometry.head_start, self.geometry.num_kv_heads)
        return spec, self.receivers[transport].expect(spec, timeout=timeout_s)

    def cancel(self, transport: str, transfer_id: str) -> None:
        self.receivers[transport].cancel(transfer_id)

    @property
    def stats(self) -> ReceiverStats:
        """Rank 0's counters over its transports (thread-safe)."""
        return total_stats(ReceiverStats, self.stats_by_transport().values())

    def stats_by_transport(self) -> dict[str, ReceiverStats]:
        return {name: r.stats for name, r in self.receivers.items()}

    # -- engine thread ----------------------------------------------------------------------------
    def expect_followers(self, transport: str, spec: TransferSpec, timeout_s: float) -> None:
        self._control(
            "kv.expect",
            spec,
            transport=transport,
            timeout_s=timeout_s,
            block_ids=list(spec.block_ids),
            token=spec.token.hex(),
        )

    def await_followers(self, spec: TransferSpec, timeout_s: float) -> None:
        """Wait until every other rank has its heads of the transfer (TransferError if not)."""
        for reply in self._control("kv.await", spec, timeout_s=timeout_s):
            if not reply.get("ok"):
                raise TransferError(f"a decode rank did not get its KV: {reply.get('error')}")

    def cancel_followers(self, spec: TransferSpec) -> None:
        self._control("kv.cancel", spec)

    def _control(self, op: str, spec: TransferSpec, **args: object) -> list[dict[str, object]]:
        if self.engine.tp_driver is None:
            return []
        return self.engine.tp_driver.control(op, {"transfer_id": spec.transfer_id, **args})

    def bytes_received(self) -> int:
        """Over every rank (engine thread when there are followers)."""
        total = self.stats.bytes_received
        if self.engine.tp_driver is not None:
            total += sum(r["bytes_received"] for r in self.engine.tp_driver.control("kv.stats", {}))
        return total

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()
