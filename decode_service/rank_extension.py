"""A decode worker's code on its other tensor-parallel ranks: their KV receivers."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pdmesh.decode_service.kv_receivers import advertised, rank_geometry
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.parallel import ParallelGroup
from pdmesh.kv_transfer import TransferSpec, TransferStats, create_receiver


class DecodeRankExtension:
    def __init__(self, runner: ModelRunner, group: ParallelGroup, options: dict[str, Any]) -> None:
        self.geometry = rank_geometry(runner)
        self.receiver = create_receiver(
            options["transport"], runner.kv_cache.data, self.geometry, options["bind"]
        )
        self.address = advertised(self.receiver.endpoint, options.get("advertise"))
        self._futures: dict[str, Future[TransferStats]] = {}

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "kv.endpoint":
            g = self.geometry
            return {
                "address": self.address,
                "head_start": g.head_start,
                "num_heads": g.num_kv_heads,
            }
        if op == "kv.expect":
            spec = TransferSpec(
                args["transfer_id"],
                bytes.fromhex(args["token"]),
                tuple(args["block_ids"]),
                self.geometry.head_start,
                self.geometry.num_kv_heads,
            )
            self._futures[spec.transfer_id] = self.receiver.expect(spec, args["timeout_s"])
            return {}
        if op == "kv.await":
            future = self._futures.pop(args["transfer_id"], None)
            if future is None:
                return {"ok": False, "error": "unknown transfer"}
            try:
                future.result(timeout=args["timeout_s"])
            except FutureTimeout:
                self.receiver.cancel(args["transfer_id"])
                return {"ok": False, "error": "timed out"}
            except Exception as e:
                return {"ok": False, "error": str(e)}
            return {"ok": True}
        if op == "kv.cancel":
            self._futures.pop(args["transfer_id"], None)
            self.receiver.cancel(args["transfer_id"])
            return {}
        if op == "kv.stats":
            return {"bytes_received": self.receiver.stats.bytes_received}
        raise RuntimeError(f"unknown decode control op {op!r}")

    def close(self) -> None:
        self.receiver.close()
