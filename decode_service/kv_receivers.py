"""A decode worker's KV receivers: one per tensor-parallel rank, each holding its KV heads.

Rank 0's receiver lives here; the other ranks' live in their rank extension and are driven by
control operations, which run on the engine thread (methods marked so) because they are
collectives over the worker's process group.
"""

from __future__ import annotations

from concurrent.futures import Future

from pdmesh.decode_service.config import DecodeConfig
from pdmesh.decode_service.prefill_client import KVDestination
from pdmesh.engine.kv_layout import kv_heads
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.kv_transfer import (
    KVReceiver,
    PageGeometry,
    TransferError,
    TransferSpec,
    TransferStats,
    create_receiver,
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
        "transport": config.kv_transport,
        "bind": config.kv_bind,
        # Every other rank binds a port of its own: only the host is shared.
        "advertise": split_advertise(config.kv_advertise)[0] if config.kv_advertise else None,
    }


class KVReceivers:
    def __init__(self, engine: LLMEngine, config: DecodeConfig) -> None:
        self.engine = engine
        self.geometry = rank_geometry(engine.runner)
        self.receiver: KVReceiver = create_receiver(
            config.kv_transport, engine.runner.kv_cache.data, self.geometry, config.kv_bind
        )
        self.address = advertised(self.receiver.endpoint, config.kv_advertise)
        g = self.geometry
        self.destinations = [KVDestination(self.address, g.head_start, g.num_kv_heads)]
        self.followers = engine.tp_driver is not None
        if engine.tp_driver is not None:  # before the engine thread starts: safe to call here
            for reply in engine.tp_driver.control("kv.endpoint", {}):
                self.destinations.append(
                    KVDestination(reply["address"], reply["head_start"], reply["num_heads"])
                )

    def expect(
        self, block_ids: list[int], timeout_s: float
    ) -> tuple[TransferSpec, Future[TransferStats]]:
        spec = TransferSpec.new(block_ids, self.geometry.head_start, self.geometry.num_kv_heads)
        return spec, self.receiver.expect(spec, timeout=timeout_s)

    # -- engine thread ----------------------------------------------------------------------------
    def expect_followers(self, spec: TransferSpec, timeout_s: float) -> None:
        self._control(
            "kv.expect",
            spec,
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
        total = self.receiver.stats.bytes_received
        if self.engine.tp_driver is not None:
            total += sum(r["bytes_received"] for r in self.engine.tp_driver.control("kv.stats", {}))
        return total

    def close(self) -> None:
        self.receiver.close()
