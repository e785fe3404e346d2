"""A decode worker's code on its other tensor-parallel ranks: their KV receivers."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from pdmesh.decode_service.kv_receivers import open_receivers, rank_geometry, receiver_addresses
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.parallel import ParallelGroup
from pdmesh.kv_transfer import KVReceiver, ReceiverStats, TransferSpec, TransferStats, total_stats


class DecodeRankExtension:
    def __init__(self, runner: ModelRunner, group: ParallelGroup, options: dict[str, Any]) -> None:
        self.geometry = rank_geometry(runner)
        self.receivers = open_receivers(
            options["transports"], runner.kv_cache.data, self.geometry, options["bind"]
        )
        self.addresses = receiver_addresses(self.receivers, options.get("advertise"))
        self._futures: dict[str, tuple[KVReceiver, Future[TransferStats]]] = {}

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "kv.endpoint":
            g = self.geometry
            return {
                "addresses": self.addresses,
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
            receiver = self.receivers[args["transport"]]
            self._futures[spec.transfer_id] = receiver, receiver.expect(spec, args["timeout_s"])
            return {}
        if op == "kv.await":
            entry = self._futures.pop(args["transfer_id"], None)
            if entry is None:
                return {"ok": False, "error": "unknown transfer"}
            receiver, future = entry
            try:
                future.result(timeout=args["timeout_s"])
            except FutureTimeout:
                receiver.cancel(args["transfer_id"])
                return {"ok": False, "error": "timed out"}
            except Exception as e:
                return {"ok": False, "error": str(e)}
            return {"ok": True}
        if op == "kv.cancel":
            entry = self._futures.pop(args["transfer_id"], None)
            if entry is not None:
                entry[0].cancel(args["transfer_id"])
            return {}
        if op == "kv.stats":
            stats = total_stats(ReceiverStats, (r.stats for r in self.receivers.values()))
            return {"bytes_received": stats.bytes_received}
        raise RuntimeError(f"unknown decode control op {op!r}")

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
