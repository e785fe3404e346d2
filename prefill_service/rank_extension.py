"""A prefill worker's code on its other tensor-parallel ranks: their KV pushes."""

from __future__ import annotations

import threading
from typing import Any

from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.parallel import ParallelGroup
from pdmesh.kv_transfer import TransferError
from pdmesh.logger import get_logger
from pdmesh.prefill_service.pusher import Endpoint, KVPusher

log = get_logger(__name__)


class PrefillRankExtension:
    def __init__(self, runner: ModelRunner, group: ParallelGroup, options: dict[str, Any]) -> None:
        self.pusher = KVPusher(runner)

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "kv.push_start":
            endpoints = [Endpoint(**e) for e in args["endpoints"]]
            self.pusher.start(
                args["job_id"],
                args["transport"],
                args["transfer_id"],
                bytes.fromhex(args["token"]),
                args["num_blocks"],
                endpoints,
            )
        elif op == "kv.push_end":
            # Rank 0 does not wait: the decode worker checks that every rank's heads arrived.
            threading.Thread(
                target=self._finish, args=(args["job_id"], args["timeout_s"]), daemon=True
            ).start()
        elif op == "kv.push_abort":
            self.pusher.abort(args["job_id"])
        elif op == "kv.stats":
            return {"bytes_sent": self.pusher.stats.bytes_sent}
        else:
            raise RuntimeError(f"unknown prefill control op {op!r}")
        return {}

    def _finish(self, job_id: int, timeout_s: float) -> None:
        try:
            self.pusher.finish(job_id, timeout_s)
        except TransferError as e:
            log.warning("KV push of job %d failed on this rank: %s", job_id, e)

    def close(self) -> None:
        self.pusher.close()
