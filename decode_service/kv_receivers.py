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


def advertised(endpoint: str, advertise_host: str | None) -> str:
    if advertise_host is None:
        return endpoint
    return f"tcp://{advertise_host}:{endpoint.rsplit(':', 1)[1]}"


def extension_options(config: DecodeConfig) -> dict[str, object]:
    return {
        "transport": config.kv_transport,
        "bind": config.kv_bind,
        "advertise": config.kv_advertise,
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
