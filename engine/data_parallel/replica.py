"""A data-parallel replica after the first (`python -m pdmesh.engine.data_parallel.replica`,
started by the front with its spec in PDMESH_DP_SPEC): one engine that serves the front's
messages over a ZeroMQ pair socket, one reply to each, in order.

Messages (JSON objects, `op` first): `add` (a request; reply `{}` or the ValueError naming its
field), `abort`, `step` (run one engine step; reply its deltas, the outputs of the requests it
finished, which the replica then forgets, and whether requests remain), `experts` (tokens routed
to each expert), `stats` (the engine's load and counters), `eplb` (EPLB's counters), `profile`
(torch.profiler started, or with `trace` stopped and written to TRACE.rank{N}.json, N this
replica's first global rank) and `stop`.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

import zmq
from torch.profiler import record_function

from pdmesh import envs
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.data_parallel import codec
from pdmesh.engine.data_parallel.group import moe_group
from pdmesh.engine.executor.profiling import ProfileRank, RankProfiler
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.parallel.comm import destroy
from pdmesh.kv_transfer.connector import encode
from pdmesh.logger import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica starts from: the engine's config (its own device), its index among the
    replicas, the front's socket, and under data-parallel attention the rendezvous of the
    replicas' MoE group (tcp://HOST:PORT; None: a dense replica of its own)."""

    engine: dict[str, Any]
    rank: int
    endpoint: str
    moe_init_method: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> ReplicaSpec:
        return ReplicaSpec(**json.loads(text))


def serve(engine: LLMEngine, sock: zmq.Socket[bytes], rank: int) -> None:
    """Answer the front's messages until `stop`; `rank`: this replica's index."""
    profiler = RankProfiler()
    while True:
        with record_function("dp.wait_front"):
            msg = json.loads(sock.recv())
        op = msg["op"]
        if op == "stop":
            return
        if op == "profile":
            message = ProfileRank(trace=msg["trace"], host=msg["host"])
            profiler.handle(message, rank * engine.config.world_size)
            sock.send(b"{}")
            continue
        with record_function(f"dp.{op}"):
            sock.send(json.dumps(_answer(engine, op, msg)).encode())


def _answer(engine: LLMEngine, op: str, msg: dict[str, Any]) -> dict[str, Any]:
    if op == "add":
        try:
            params = codec.params_from_json(msg["params"])
            engine.add_request(msg["request_id"], msg["prompt"], params)
        except ValueError as e:
            return {"error": str(e), "field": getattr(e, "field", None)}
        return {}
    if op == "abort":
        rid = msg["request_id"]
        delta = engine.abort_request(rid)
        return {
            "delta": codec.delta_to_json(delta) if delta is not None else None,
            "output": _take_output(engine, rid),
        }
    if op == "step":
        deltas = engine.step()
        outputs = {
            d.request_id: _take_output(engine, d.request_id) for d in deltas if d.request_finished
        }
        return {
            "deltas": [codec.delta_to_json(d) for d in deltas],
            "outputs": outputs,
            "unfinished": engine.has_unfinished_requests(),
        }
    if op == "experts":
        return {"counts": engine.expert_counts()}
    if op == "stats":
        return {"stats": dataclasses.asdict(engine.stats())}
    if op == "eplb":
        balancer = engine.runner.balancer
        return {"counts": encode(balancer.counts()).decode() if balancer is not None else None}
    raise ValueError(f"unknown data-parallel message {op!r}")


def _take_output(engine: LLMEngine, request_id: str) -> dict[str, Any] | None:
    """A finished request's output, forgotten here (the front keeps it); None if running."""
    if not engine.is_finished(request_id):
        return None
    out = codec.output_to_json(engine.get_output(request_id))
    engine.release(request_id)
    return out


def main() -> None:
    # `kill -USR1 PID` prints where each of a stuck replica's threads is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = ReplicaSpec.from_json(envs.dp_spec())
    config = EngineConfig(**spec.engine)
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(spec.endpoint)
    moe = None
    try:
        if spec.moe_init_method is not None:
            device = config.torch_device()
            moe = moe_group(spec.rank, config.data_parallel_size, spec.moe_init_method, device)
        engine = LLMEngine(config, moe_group=moe)
    except BaseException as e:
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        raise
    sock.send(json.dumps({"ready": True}).encode())
    try:
        serve(engine, sock, spec.rank)
    except BaseException:
        # The front reads this instead of a reply and raises it there.
        sock.send(json.dumps({"fatal": traceback.format_exc()}).encode())
        raise
    finally:
        engine.close()
        sock.close(linger=1000)
        if moe is not None and moe.device.type == "cuda":
            # NCCL's teardown, graceful or aborted, waited forever on two H100s for the
            # collectives captured in CUDA graphs: the process ends without it (the driver
            # frees the GPU), before Python's finalization runs it.
            os._exit(0)
        destroy()


if __name__ == "__main__":
    main()
