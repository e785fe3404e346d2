"""KV transfer between two GPUs: the `nccl` transport against raw NCCL point-to-point.

    python -m pdmesh.bench.kv_transfer_gpu --out DIR        # on a machine with 2 GPUs

Two processes, one per GPU (receiver: a decode rank on cuda:1; sender: a prefill rank on cuda:0),
each seeing both GPUs. The ceiling is measured in the same run: NCCL send/recv of one 512 MiB
buffer between the same two processes. So is the candidate for an `ipc` transport: a copy of
512 MiB from the sender's GPU straight into a buffer of the receiver's, opened through a CUDA IPC
handle (the handle's fields travel as JSON, never pickled), and the copy engines' own rate
between the two GPUs: the same copy inside the sender's process (peer access on).
Then a 4,096-token prompt of the Llama-3.1-8B shape (32 layers x 256 blocks of 16 tokens x 8
KV heads x 128 dims, bf16: 512 MiB) is pushed layer by layer through the `nccl` transport into
shuffled destination blocks, and checked byte for byte. The processes talk over stdin/stdout in
JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LAYERS, HEADS, DIM, BS, BLOCKS = 32, 8, 128, 16, 256
REPEATS = 10


def geometry() -> Any:
    from pdmesh.kv_transfer import PageGeometry

    return PageGeometry(
        num_layers=LAYERS,
        block_size=BS,
        num_kv_heads=HEADS,
        head_start=0,
        head_dim=DIM,
        dtype=torch.bfloat16,
    )


def raw_p2p(rank: int, init: str) -> float | None:
    """GB/s of NCCL send/recv of 512 MiB (measured on the receiver, rank 1)."""
    dist.init_process_group(
        "nccl", init_method=init, rank=rank, world_size=2, device_id=torch.device("cuda", rank)
    )
    buf = torch.empty(256 << 20, dtype=torch.bfloat16, device="cuda")  # 512 MiB
    if rank == 0:
        buf.normal_()
    times = []
    for _ in range(REPEATS + 2):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return buf.numel() * 2 / statistics.median(times[2:]) / 1e9 if rank == 1 else None


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def progress(role: str, what: str) -> None:
    """On stderr, so that a hang shows where it is (stdout carries the protocol)."""
    print(f"[{role} {time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def share(buf: torch.Tensor) -> list[Any]:
    """A CUDA IPC handle of `buf`'s storage, as JSON-able fields."""
    fields = buf.untyped_storage()._share_cuda_()
    return [f.hex() if isinstance(f, bytes) else f for f in fields]


def open_shared(fields: list[Any]) -> torch.Tensor:
    """The receiver's buffer, mapped into this process (flat uint8)."""
    args = [bytes.fromhex(f) if i in (1, 4, 6) else f for i, f in enumerate(fields)]
    storage = torch.UntypedStorage._new_shared_cuda(*args)
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def receiver(init: str) -> None:
    from pdmesh.kv_transfer import TransferSpec, create_receiver

    torch.cuda.set_device(1)
    progress("receiver", "raw p2p")
    gbps = raw_p2p(1, init)
    progress("receiver", f"raw p2p done: {gbps:.0f} GB/s")
    geo = geometry()
    cache = torch.zeros(geo.cache_shape(BLOCKS + 64), dtype=geo.dtype, device="cuda")
    ipc_target = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    rx = create_receiver("nccl", cache, geo, "tcp://127.0.0.1:0")
    emit({"raw_p2p_gb_s": gbps, "endpoint": rx.endpoint, "ipc": share(ipc_target)})
    gen = torch.Generator().manual_seed(0)
    for _ in range(REPEATS + 1):
        blocks = (torch.randperm(BLOCKS + 64, generator=gen)[:BLOCKS]).tolist()
        spec = TransferSpec.new(blocks, 0, HEADS)
        done = rx.expect(spec, timeout=120)
        emit({"transfer_id": spec.transfer_id, "token": spec.token.hex(), "blocks": blocks})
        progress("receiver", f"expecting {spec.transfer_id}")
        stats = done.result(timeout=120)
        progress("receiver", f"received {stats.bytes} bytes in {stats.seconds:.3f} s")
        checksum = float(cache[:, :, blocks].float().sum())
        emit({"bytes": stats.bytes, "seconds": stats.seconds, "checksum": checksum})
    rx.close()


def sender(init: str) -> None:
    from pdmesh.kv_transfer import create_sender

    torch.cuda.set_device(0)
    progress("sender", "raw p2p")
    raw_p2p(0, init)
    progress("sender", "raw p2p done")
    geo = geometry()
    source = torch.randn(geo.cache_shape(BLOCKS), device="cuda").to(geo.dtype)
    expected = float(source.float().sum())
    tx = create_sender("nccl", geo)
    hello = json.loads(sys.stdin.readline())
    endpoint = hello["endpoint"]
    emit({"ipc_copy_gb_s": ipc_copy(source, hello["ipc"])})
    for _ in range(REPEATS + 1):
        job = json.loads(sys.stdin.readline())
        progress("sender", f"starting {job['transfer_id']} to {endpoint}")
        h = tx.start(endpoint, job["transfer_id"], bytes.fromhex(job["token"]), BLOCKS)
        progress("sender", "pair ready; sending")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for layer in range(LAYERS):  # as a prefill pushes it: one layer at a time
            tx.send_layer(h, layer, 0, source[layer, 0], source[layer, 1])
        stats = tx.finish(h, timeout=120)
        emit(
            {
                "send_seconds": time.perf_counter() - start,
                "bytes": stats.bytes,
                "expected_checksum": expected,
            }
        )
    # Last: it makes a context on the other GPU in this process, which the transfers must not
    # share their GPUs with.
    emit({"peer_copy_gb_s": peer_copy(source)})
    tx.close()


def peer_copy(source: torch.Tensor) -> float:
    """GB/s of copying 512 MiB from this GPU to the other inside this process (copy engines over
    NVLink, peer access on): the most a same-host `ipc` transport could reach."""
    local = source.view(-1).view(torch.uint8)[: 512 << 20]
    return _copy_rate(torch.empty_like(local, device="cuda:1"), local)


def ipc_copy(source: torch.Tensor, fields: list[Any]) -> float:
    """GB/s of copying 512 MiB from this GPU into the receiver's buffer through CUDA IPC."""
    peer = open_shared(fields)
    return _copy_rate(peer, source.view(-1).view(torch.uint8)[: peer.numel()])


def _copy_rate(dst: torch.Tensor, src: torch.Tensor) -> float:
    """GB/s of dst.copy_(src) across two GPUs, median of REPEATS after two warm-ups (NaN if the
    bytes do not arrive)."""
    times = []
    for _ in range(REPEATS + 2):
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)
        torch.cuda.synchronize(src.device)
        times.append(time.perf_counter() - start)
    ok = bool(torch.equal(dst[:4096].cpu(), src[:4096].cpu()))
    return src.numel() / statistics.median(times[2:]) / 1e9 if ok else float("nan")


def _close(a: float, b: float) -> bool:
    """Sums of the same bf16 values in another order agree to float rounding."""
    return abs(a - b) <= 1e-3 * abs(b) + 1.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--role", choices=["sender", "receiver"])
    parser.add_argument("--init")
    args = parser.parse_args()
    if args.role == "receiver":
        receiver(args.init)
        return
    if args.role == "sender":
        sender(args.init)
        return
    from pdmesh.engine.distributed import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    me = [sys.executable, "-m", "pdmesh.bench.kv_transfer_gpu", "--init", init]
    env = dict(os.environ)
    rx = subprocess.Popen([*me, "--role", "receiver"], stdout=subprocess.PIPE, text=True, env=env)
    tx = subprocess.Popen(
        [*me, "--role", "sender"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert rx.stdout and tx.stdin and tx.stdout

    def from_rx() -> dict[str, Any]:
        return json.loads(rx.stdout.readline())

    hello = from_rx()
    tx.stdin.write(json.dumps({"endpoint": hello["endpoint"], "ipc": hello["ipc"]}) + "\n")
    tx.stdin.flush()
    ipc_gb_s = json.loads(tx.stdout.readline())["ipc_copy_gb_s"]
    runs = []
    for _ in range(REPEATS + 1):
        job = from_rx()
        tx.stdin.write(json.dumps(job) + "\n")
        tx.stdin.flush()
        sent = json.loads(tx.stdout.readline())
        got = from_rx()
        runs.append({**sent, **got})
    copies = json.loads(tx.stdout.readline())
    rx.wait(60)
    tx.wait(60)
    timed = runs[1:]  # the first builds the pair's communicator
    seconds = statistics.median(r["seconds"] for r in timed)
    send_seconds = statistics.median(r["send_seconds"] for r in timed)
    gb = timed[0]["bytes"] / 1e9
    result = {
        "raw_nccl_p2p_gb_s": hello["raw_p2p_gb_s"],
        "kv_bytes": timed[0]["bytes"],
        "kv_receiver_seconds": seconds,
        "kv_gb_s": gb / seconds,
        # Run to run, the receiver's span moves with how fast the sending process's Python
        # queues the 32 layers (its thread and the pair thread share one GIL).
        "kv_gb_s_min_max": [
            gb / max(r["seconds"] for r in timed),
            gb / min(r["seconds"] for r in timed),
        ],
        "kv_sender_seconds": send_seconds,
        "ratio_to_raw": gb / seconds / hello["raw_p2p_gb_s"],
        "bytes_checked": all(_close(r["checksum"], r["expected_checksum"]) for r in runs),
        "first_transfer_seconds": runs[0]["seconds"],
        "ipc_copy_gb_s": ipc_gb_s,
        "ipc_over_raw_nccl": ipc_gb_s / hello["raw_p2p_gb_s"],
        "peer_copy_gb_s": copies["peer_copy_gb_s"],
        "peer_copy_over_raw_nccl": copies["peer_copy_gb_s"] / hello["raw_p2p_gb_s"],
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_transfer.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
