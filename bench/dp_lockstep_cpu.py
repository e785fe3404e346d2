"""The host's share of a lockstep step of data-parallel replicas, on the CPU: what each step of
DP + EP costs beyond the replicas' own forwards.

    python -m pdmesh.bench.dp_lockstep_cpu [--steps 2000]

Two figures, each timed over `--steps` repetitions between two real processes on loopback:
- agree: the gloo all-reduce of two integers by which the replicas agree on a step's size and
  whether it fits a CUDA graph (`ModelRunner._agree`'s collective);
- round trip: the front's `step` message to a replica and the reply, JSON over a ZeroMQ pair
  socket, with a decode step's reply of 64 one-token deltas (what `front.py` and `replica.py`
  exchange), the replica doing nothing else.
Prints JSON: microseconds per repetition (median of 5 runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import zmq

from pdmesh.engine.data_parallel import codec
from pdmesh.engine.outputs import StepDelta
from pdmesh.processes import free_port


def _agree_rank(rank: int, port: int, steps: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        runs = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for i in range(steps):
                t = torch.tensor([i, 0], dtype=torch.int64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                t.tolist()
            runs.append((time.perf_counter() - start) / steps * 1e6)
        if rank == 0:
            Path(out).write_text(json.dumps(statistics.median(runs)))
    finally:
        dist.destroy_process_group()


def _replica(endpoint: str) -> None:
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(endpoint)
    deltas = [codec.delta_to_json(StepDelta(f"r{i}", [1234], "ab", None)) for i in range(64)]
    reply = json.dumps({"deltas": deltas, "outputs": {}, "unfinished": True}).encode()
    while True:
        msg = json.loads(sock.recv())
        if msg["op"] == "stop":
            break
        sock.send(reply)
    sock.close(linger=0)


def round_trip_us(steps: int) -> float:
    sock = zmq.Context.instance().socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_replica, args=(f"tcp://127.0.0.1:{port}",))
    proc.start()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            sock.send(json.dumps({"op": "step"}).encode())
            reply = json.loads(sock.recv())
            [codec.delta_from_json(d) for d in reply["deltas"]]
        runs.append((time.perf_counter() - start) / steps * 1e6)
    sock.send(json.dumps({"op": "stop"}).encode())
    proc.join(10)
    sock.close(linger=0)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "agree.json")
        mp.spawn(_agree_rank, args=(free_port(), args.steps, out), nprocs=2, join=True)
        agree = json.loads(Path(out).read_text())
    result = {
        "device": f"CPU, {os.cpu_count()} cores",
        "steps": args.steps,
        "agree_us": round(agree, 1),
        "round_trip_64_deltas_us": round(round_trip_us(args.steps), 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
