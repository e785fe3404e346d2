"""KV transfer between two GPUs: the `nccl` transport against raw NCCL point-to-point.

    python -m pdmesh.bench.kv_transfer_gpu --out DIR        # on a machine with 2 GPUs

Two processes (sender: a prefill rank on cuda:0; receiver: a decode rank on cuda:1) talk over
stdin/stdout in JSON lines. Ceilings from the same run: NCCL send/recv of one 512 MiB buffer, a
512 MiB copy into the receiver's buffer through a CUDA IPC handle (fields as JSON, never pickled:
the `ipc` candidate), and that copy within the sender's process (peer access on). Then a
4,096-token Llama-3.1-8B prompt (32 layers x 256 blocks of 16 x 8 KV heads x 128, bf16: 512 MiB)
goes through the `nccl` transport between shuffled blocks, checked byte for byte, as "layers"
(`send_blocks` after each layer, as a prefill pushes) and "whole" (`send_layers`, as cached
blocks go): timed from the sender's first call to the receiver's future resolved (one monotonic
clock) and on the receiver's own span. --timeline adds one transfer's steps per mode
(bench/kv_timeline.py), in ms from the sender's first call.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from pdmesh.bench import kv_timeline
from pdmesh.bench.report import Report, out_parser

LAYERS, HEADS, DIM, BS, BLOCKS = 32, 8, 128, 16, 256
REPEATS = 10
# "layers": send_blocks after each layer, as a prefill pushes; "whole": send_layers, every layer
# at once, as blocks cached before the step go.
MODES = ("layers", "whole")


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


def raw_p2p(rank: int, init: str) -> tuple[float, float]:
    """GB/s of NCCL send/recv of 512 MiB (meaningful on the receiver, rank 1), and the host time
    in µs of posting one small send or recv (median of 50)."""
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
    small = buf[: 1 << 19]  # 1 MiB
    posts = []
    for _ in range(50):
        start = time.perf_counter()
        work = dist.isend(small, 1) if rank == 0 else dist.irecv(small, 0)
        posts.append(time.perf_counter() - start)
        assert work is not None
        work.wait()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return buf.numel() * 2 / statistics.median(times[2:]) / 1e9, statistics.median(posts) * 1e6


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


def start_role(role: str, init: str, timeline: bool) -> tuple[float, float]:
    """A process's first steps: its stamps (with --timeline), its GPU (the receiver's is cuda:1),
    and raw NCCL p2p with the other process (what `raw_p2p` returns)."""
    rank = 1 if role == "receiver" else 0
    if timeline:
        (kv_timeline.stamp_receiver if rank else kv_timeline.stamp_sender)()
    torch.cuda.set_device(rank)
    progress(role, "raw p2p")
    gbps, post_us = raw_p2p(rank, init)
    progress(role, f"raw p2p done: {gbps:.0f} GB/s")
    return gbps, post_us


def receiver(init: str, timeline: bool) -> None:
    from pdmesh.kv_transfer import TransferSpec, create_receiver

    gbps, post_us = start_role("receiver", init, timeline)
    geo = geometry()
    cache = torch.zeros(geo.cache_shape(BLOCKS + 64), dtype=geo.dtype, device="cuda")
    ipc_target = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    rx = create_receiver("nccl", cache, geo, "tcp://127.0.0.1:0")
    hello = {"raw_p2p_gb_s": gbps, "recv_post_us": post_us, "endpoint": rx.endpoint}
    emit({**hello, "ipc": share(ipc_target)})
    gen = torch.Generator().manual_seed(0)
    for _ in range(len(MODES) * (REPEATS + 1)):
        blocks = (torch.randperm(BLOCKS + 64, generator=gen)[:BLOCKS]).tolist()
        spec = TransferSpec.new(blocks, 0, HEADS)
        done = rx.expect(spec, timeout=120)
        emit({"transfer_id": spec.transfer_id, "token": spec.token.hex(), "blocks": blocks})
        progress("receiver", f"expecting {spec.transfer_id}")
        stats = done.result(timeout=120)
        done_at = time.monotonic()  # one clock for both processes (CLOCK_MONOTONIC)
        stamps = [*kv_timeline.drain_stamps(), (done_at, "future resolved")]
        progress("receiver", f"received {stats.bytes} bytes in {stats.seconds:.3f} s")
        checksum = float(cache[:, :, blocks].float().sum())
        emit(
            {
                "bytes": stats.bytes,
                "seconds": stats.seconds,
                "done_at": done_at,
                "checksum": checksum,
                "rx_stamps": stamps if timeline else [],
            }
        )
    rx.close()


def sender(init: str, timeline: bool) -> None:
    from pdmesh.kv_transfer import create_sender

    _, post_us = start_role("sender", init, timeline)
    geo = geometry()
    source = torch.randn(geo.cache_shape(BLOCKS + 64), device="cuda").to(geo.dtype)
    ids = torch.randperm(BLOCKS + 64, generator=torch.Generator().manual_seed(1))[:BLOCKS]
    expected = float(source[:, :, ids].float().sum())
    ids = ids.cuda()
    tx = create_sender("nccl", geo)
    hello = json.loads(sys.stdin.readline())
    endpoint = hello["endpoint"]
    emit({"ipc_copy_gb_s": ipc_copy(source, hello["ipc"]), "send_post_us": post_us})
    for _ in range(len(MODES) * (REPEATS + 1)):
        job = json.loads(sys.stdin.readline())
        progress("sender", f"starting {job['transfer_id']} to {endpoint} ({job['mode']})")
        h = tx.start(endpoint, job["transfer_id"], bytes.fromhex(job["token"]), BLOCKS)
        progress("sender", "pair ready; sending")
        torch.cuda.synchronize()
        kv_timeline.drain_stamps()
        started_at = time.monotonic()
        start = time.perf_counter()
        if job["mode"] == "layers":  # as a prefill pushes it: after each layer, its blocks
            for layer in range(LAYERS):
                tx.send_blocks([h], layer, 0, source[layer], ids)
        else:  # blocks cached before the step: every layer at once
            tx.send_layers([h], 0, source, ids)
        stats = tx.finish(h, timeout=120)
        emit(
            {
                "send_seconds": time.perf_counter() - start,
                "started_at": started_at,
                "bytes": stats.bytes,
                "expected_checksum": expected,
                "tx_stamps": kv_timeline.drain_stamps() if timeline else [],
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


def _summary(timed: list[dict[str, Any]], raw: float) -> dict[str, Any]:
    """GB/s of a mode's transfers: end to end (the sender's first call -> the receiver's future
    resolved, one host clock) and on the receiver's own span (its first payload handled -> last
    block written); medians with min and max, and ratios to raw NCCL."""
    gb = timed[0]["bytes"] / 1e9
    e2e = [r["done_at"] - r["started_at"] for r in timed]
    span = [r["seconds"] for r in timed]
    out = {"e2e_seconds": statistics.median(e2e)}
    for name, seconds in (("e2e", e2e), ("receiver", span)):
        out[f"{name}_gb_s"] = gb / statistics.median(seconds)
        out[f"{name}_gb_s_min_max"] = [gb / max(seconds), gb / min(seconds)]
        out[f"{name}_ratio_to_raw"] = out[f"{name}_gb_s"] / raw
    return out | {"sender_seconds": statistics.median(r["send_seconds"] for r in timed)}


def _close(a: float, b: float) -> bool:
    """Sums of the same bf16 values in another order agree to float rounding."""
    return abs(a - b) <= 1e-3 * abs(b) + 1.0


def main() -> None:
    parser = out_parser(__doc__, out_required=False)
    parser.add_argument("--role", choices=["sender", "receiver"])
    parser.add_argument("--init")
    parser.add_argument("--timeline", action="store_true", help="stamp each transfer's steps")
    args = parser.parse_args()
    if args.role:
        (receiver if args.role == "receiver" else sender)(args.init, args.timeline)
        return
    from pdmesh.processes import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    me = [sys.executable, "-m", "pdmesh.bench.kv_transfer_gpu", "--init", init]
    if args.timeline:
        me.append("--timeline")
    pipe = subprocess.PIPE
    rx = subprocess.Popen([*me, "--role", "receiver"], stdout=pipe, text=True)
    tx = subprocess.Popen([*me, "--role", "sender"], stdin=pipe, stdout=pipe, text=True)
    assert rx.stdout and tx.stdin and tx.stdout

    def from_rx() -> dict[str, Any]:
        return json.loads(rx.stdout.readline())

    def to_tx(message: dict[str, Any]) -> dict[str, Any]:
        """Send the sender a line; its answer."""
        tx.stdin.write(json.dumps(message) + "\n")
        tx.stdin.flush()
        return json.loads(tx.stdout.readline())

    hello = from_rx()
    sender_hello = to_tx({"endpoint": hello["endpoint"], "ipc": hello["ipc"]})
    ipc_gb_s = sender_hello["ipc_copy_gb_s"]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for mode in MODES:
        for _ in range(REPEATS + 1):
            sent = to_tx({**from_rx(), "mode": mode})
            got = from_rx()
            runs[mode].append({**sent, **got})
    copies = json.loads(tx.stdout.readline())
    rx.wait(60)
    tx.wait(60)
    raw = hello["raw_p2p_gb_s"]
    result: dict[str, Any] = {
        "raw_nccl_p2p_gb_s": raw,
        "nccl_post_us": {"send": sender_hello["send_post_us"], "recv": hello["recv_post_us"]},
        "kv_bytes": runs[MODES[0]][1]["bytes"],
        "bytes_checked": all(
            _close(r["checksum"], r["expected_checksum"]) for rs in runs.values() for r in rs
        ),
        "first_transfer_seconds": runs[MODES[0]][0]["seconds"],
    }
    for mode, rs in runs.items():
        result[mode] = _summary(rs[1:], raw)  # the very first builds the pair's communicator
    result |= {
        "ipc_copy_gb_s": ipc_gb_s,
        "ipc_over_raw_nccl": ipc_gb_s / hello["raw_p2p_gb_s"],
        "peer_copy_gb_s": copies["peer_copy_gb_s"],
        "peer_copy_over_raw_nccl": copies["peer_copy_gb_s"] / hello["raw_p2p_gb_s"],
    }
    if args.timeline:  # the median transfer of each mode
        result["timeline_ms"] = {mode: kv_timeline.timeline(rs[1:]) for mode, rs in runs.items()}
    print(json.dumps(result, indent=1))
    if args.out:
        Report(args.out / "kv_transfer.json", indent=1, **result).save()


if __name__ == "__main__":
    main()
