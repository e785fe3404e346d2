"""The front end of `data_parallel_size` engine replicas: the first replica in this process,
the others as processes of this node (`replica.py`), behind LLMEngine's offline interface
(what `LLM` calls: add_request, step, get_output, ...).

Each request goes to the replica with the fewest unfinished requests (vLLM's internal load
balancing) and stays there with its KV. A step steps every replica with requests at once (each
its own batch; the front waits for the slowest): dense replicas only when they have requests,
and under data-parallel attention (an MoE model with enable_expert_parallel) all of them or
none, since their MoE layers exchange tokens within each step. Replica i runs on the base
device's GPU i x (tensor x pipeline ranks); on a CPU they share its cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

import torch
import zmq
from torch.profiler import record_function

from pdmesh import envs
from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.data_parallel import codec
from pdmesh.engine.data_parallel.group import moe_data_parallel, moe_group
from pdmesh.engine.data_parallel.replica import ReplicaSpec
from pdmesh.engine.eplb.balancer import EplbCounts, EplbStats
from pdmesh.engine.executor.driver import rank_device
from pdmesh.engine.llm_engine import LLMEngine
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.outputs import EngineStats, RequestOutput, StepDelta
from pdmesh.engine.parallel.comm import destroy, serve_store
from pdmesh.errors import InvalidRequest
from pdmesh.kernels.cpu.threads import set_cpu_threads
from pdmesh.kv_transfer.connector import decode
from pdmesh.logger import get_logger
from pdmesh.sampling_params import SamplingParams
from pdmesh.warm_start import start_module

log = get_logger(__name__)

POLL_MS = 200  # how often a wait for a replica checks that its process still runs


class Replicas:
    """Replicas 1 .. N-1 as processes, each paired with a socket of the front. `ask` sends a
    message and waits for its reply; a replica that died is raised as RuntimeError."""

    def __init__(self, specs: list[ReplicaSpec], sockets: list[zmq.Socket[bytes]]) -> None:
        self.sockets = sockets
        self.procs = [
            start_module(
                "pdmesh.engine.data_parallel.replica",
                [],
                {**os.environ, "PDMESH_DP_SPEC": spec.to_json()},
            )
            for spec in specs
        ]
        self.moe = specs[0].moe_init_method is not None if specs else False
        self.nccl = bool(specs) and str(specs[0].engine["device"]).startswith("cuda")
        self._stopped = False

    def wait_ready(self) -> None:
        for i in range(len(self.procs)):
            reply = self.receive(i)
            if "error" in reply:
                raise RuntimeError(
                    f"data-parallel replica {i + 1} failed to start: {reply['error']}"
                )

    def send(self, i: int, msg: dict[str, Any]) -> None:
        self.sockets[i].send(json.dumps(msg).encode())

    def receive(self, i: int) -> dict[str, Any]:
        sock, proc = self.sockets[i], self.procs[i]
        while not sock.poll(POLL_MS):
            if proc.poll() is not None:
                raise RuntimeError(f"data-parallel replica {i + 1} exited (code {proc.returncode})")
        reply = json.loads(sock.recv())
        if "fatal" in reply:
            raise RuntimeError(f"data-parallel replica {i + 1} failed:\n{reply['fatal']}")
        return reply

    def ask(self, i: int, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(i, msg)
        return self.receive(i)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        for sock, proc in zip(self.sockets, self.procs, strict=True):
            if proc.poll() is None:
                sock.send(json.dumps({"op": "stop"}).encode())
        # On GPUs the MoE group stays as it is until this process ends: NCCL's teardown,
        # graceful or aborted, waited forever on two H100s for the collectives captured in
        # CUDA graphs (the replicas end without it). On CPUs gloo's is immediate.
        if self.moe and not self.nccl:
            destroy()
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close(linger=0)


class DataParallelEngine:
    """`config.data_parallel_size` engines behind one interface (LLM's use of LLMEngine)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        size = config.data_parallel_size
        info = ModelInfo.load(resolve_model_folder(config.model))
        self.moe_data_parallel = moe_data_parallel(config, info)
        device = config.torch_device()
        devices = [rank_device(device, r * config.world_size) for r in range(size)]
        if device.type == "cuda" and (need := devices[-1].index + config.world_size) > (
            have := torch.cuda.device_count()
        ):
            raise ValueError(
                f"data_parallel_size {size} x {config.world_size} ranks from {device} need "
                f"{need} GPUs; this machine has {have}."
            )
        if device.type == "cpu" and envs.num_threads() is None:
            set_cpu_threads((os.cpu_count() or 1) // (size * config.world_size))
        store, init_method = None, None
        if self.moe_data_parallel:
            if torch.distributed.is_initialized():
                raise ValueError(
                    "data_parallel_size with enable_expert_parallel joins this process to a "
                    "torch.distributed group, and it already is in one (another parallel engine "
                    "runs here, or one of these closed on GPUs, whose NCCL group lives until "
                    "the process ends): start this engine in a process of its own."
                )
            store = serve_store("127.0.0.1", 0)
            init_method = f"tcp://127.0.0.1:{store.port}"
        context = zmq.Context.instance()
        sockets, specs = [], []
        for r in range(1, size):
            sock = context.socket(zmq.PAIR)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            sockets.append(sock)
            engine = dataclasses.asdict(dataclasses.replace(config, device=str(devices[r])))
            specs.append(ReplicaSpec(engine, r, f"tcp://127.0.0.1:{port}", init_method))
        self.replicas = Replicas(specs, sockets)
        try:
            moe = None
            if init_method is not None:
                moe = moe_group(0, size, init_method, devices[0], store)
            first = dataclasses.replace(config, device=str(devices[0]))
            self.local = LLMEngine(first, moe_group=moe)
            self.replicas.wait_ready()
        except BaseException:
            self.replicas.shutdown(0)
            raise
        self.info = self.local.info
        self.tokenizer = self.local.tokenizer
        self._owner: dict[str, int] = {}
        self._unfinished = [0] * size  # requests each replica holds that have not ended
        self._busy = [False] * size  # replicas 1..: requests or steps on the device remain
        self._outputs: dict[str, RequestOutput] = {}  # finished on a replica, not yet released
        self.requests_per_replica = [0] * size  # requests each replica was given, since start
        log.info(
            "data parallelism: %d replicas%s", size, " (attention; experts split over them)"
            if self.moe_data_parallel else ""
        )  # fmt: skip

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.local.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request on the replica with the fewest unfinished requests; raises
        ValueError (naming the field) for bad input, as LLMEngine.add_request does."""
        if request_id in self._owner:
            raise InvalidRequest(f"request id {request_id!r} is already in use.", "request_id")
        r = min(range(len(self._unfinished)), key=self._unfinished.__getitem__)
        if r == 0:
            self.local.add_request(request_id, prompt, params)
        else:
            msg = {"op": "add", "request_id": request_id, "prompt": prompt}
            reply = self.replicas.ask(r - 1, {**msg, "params": codec.params_to_json(params)})
            if "error" in reply:
                raise InvalidRequest(reply["error"], reply["field"])
            self._busy[r] = True
        self._owner[request_id] = r
        self._unfinished[r] += 1
        self.requests_per_replica[r] += 1

    def abort_request(self, request_id: str) -> StepDelta | None:
        r = self._owner.get(request_id)
        if r is None:
            return None
        if r == 0:
            delta = self.local.abort_request(request_id)
        else:
            reply = self.replicas.ask(r - 1, {"op": "abort", "request_id": request_id})
            delta = codec.delta_from_json(reply["delta"]) if reply["delta"] else None
            if reply["output"] is not None:
                self._outputs[request_id] = codec.output_from_json(reply["output"])
        if delta is not None:
            self._unfinished[r] -= 1
        return delta

    def has_unfinished_requests(self) -> bool:
        return self.local.has_unfinished_requests() or any(self._busy[1:])

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[StepDelta]:
        """One step of every replica with work (all of them under data-parallel attention)."""
        local = self.local.has_unfinished_requests()
        remote = [r for r in range(1, len(self._busy)) if self._busy[r]]
        if self.moe_data_parallel and (local or remote):
            local, remote = True, list(range(1, len(self._busy)))
        for r in remote:  # the replicas step while this process steps its own
            self.replicas.send(r - 1, {"op": "step"})
        with record_function("dp.local_step"):
            deltas = self.local.step() if local else []
        self._count_ends(deltas, 0)
        for r in remote:
            with record_function("dp.wait_replica"):
                reply = self.replicas.receive(r - 1)
            mine = [codec.delta_from_json(d) for d in reply["deltas"]]
            for rid, out in reply["outputs"].items():
                self._outputs[rid] = codec.output_from_json(out)
            self._busy[r] = reply["unfinished"]
            self._count_ends(mine, r)
            deltas += mine
        return deltas

    def _count_ends(self, deltas: list[StepDelta], r: int) -> None:
        self._unfinished[r] -= sum(1 for d in deltas if d.request_finished)

    # -- results ------------------------------------------------------------------------------
    def get_output(self, request_id: str) -> RequestOutput:
        if self._owner[request_id] == 0:
            return self.local.get_output(request_id)
        if request_id not in self._outputs:
            raise RuntimeError(f"request {request_id} is still running on its replica")
        return self._outputs[request_id]

    def release(self, request_id: str) -> None:
        r = self._owner.get(request_id)
        if r == 0:
            self.local.release(request_id)
            if self.local.request(request_id) is None:
                del self._owner[request_id]
        elif r is not None and request_id in self._outputs:
            del self._outputs[request_id], self._owner[request_id]

    def expert_counts(self) -> list[int] | None:
        """Tokens routed to each expert since start, over every replica (None: a dense model)."""
        counts = self.local.expert_counts()
        if counts is None:
            return None
        for i in range(len(self.replicas.procs)):
            theirs = self.replicas.ask(i, {"op": "experts"})["counts"]
            counts = [a + b for a, b in zip(counts, theirs, strict=True)]
        return counts

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's load and counters, the first's first (between steps)."""
        stats = [self.local.stats()]
        for i in range(len(self.replicas.procs)):
            stats.append(EngineStats(**self.replicas.ask(i, {"op": "stats"})["stats"]))
        return stats

    def eplb_stats(self) -> EplbStats | None:
        """EPLB's figures over every replica's ranks (None: EPLB off)."""
        balancer = self.local.runner.balancer
        if balancer is None:
            return None
        counts = [balancer.counts()]
        for i in range(len(self.replicas.procs)):
            reply = decode(self.replicas.ask(i, {"op": "eplb"})["counts"].encode())
            assert isinstance(reply, EplbCounts)
            counts.append(reply)
        return balancer.stats(counts)

    def stopper(self) -> Callable[[], None]:
        """What stops the replicas and the first one's ranks, holding nothing else."""
        replicas, local = self.replicas, self.local.stopper()

        def stop() -> None:
            replicas.shutdown()
            local()

        return stop

    def close(self) -> None:
        self.stopper()()
