"""NIXL against NCCL p2p for a prompt's KV between two GPUs of one host: the evaluation issue 32
asks for before NIXL may become a KV transport.

    python -m torch.distributed.run --nproc-per-node 2 -m pdmesh.bench.nixl_gpu --out DIR

Needs `nixl` (`pip install nixl-cu13`; not a dependency of pdmesh). Rank 0 sends, rank 1
receives, a 4,096-token prompt of the 8B shape: 32 layers x (K, V) x 256 blocks of 16 tokens x
8 KV heads x 128 bf16 = 512 MiB, in the engine's cache layout ([layers, 2, blocks, 16, 8, 128]).
Each way is timed end to end on one clock (CLOCK_MONOTONIC, shared by the host's processes):
from the sender's first call to the receiver knowing the last byte landed; medians of
`--repeats`, and every transfer's bytes checked.
- `nccl_whole`: raw NCCL send / recv of the 512 MiB (the ceiling issue 32 measures against);
- `nixl_whole`: one NIXL WRITE of the 512 MiB into the receiver's registered buffer, its
  notification polled by the receiver;
- `nixl_blocks`: one WRITE of 16,384 descriptors of 32 KiB, each (layer, K/V, block) to a
  shuffled block of the receiver's cache, as paged KV lands;
- `nixl_layers`: the same blocks as 32 WRITEs, one a layer, posted back to back (layer-wise
  push), the receiver done at the last layer's notification;
- `nixl_runs16` (`_layers`): runs of 16 blocks in a row as one descriptor of 512 KiB, the runs
  shuffled (1,024 descriptors); `nixl_planes`: each (layer, K/V) plane of 8 MiB as one (64).
Rank 0 writes DIR/nixl.json and prints a table. Agents exchange their metadata (NIXL's own bytes)
and buffer addresses over a gloo group, as raw bytes: no pickle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LAYERS, BLOCKS, BLOCK_BYTES = 32, 256, 16 * 8 * 128 * 2  # 32 KiB a (layer, K/V, block)


def _exchange(data: bytes, gloo: Any) -> list[bytes]:
    """Every rank's `data`, over gloo, as raw bytes."""
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n, group=gloo)
    most = max(int(s) for s in sizes)
    mine = torch.zeros(most, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.zeros(most, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, mine, group=gloo)
    return [bytes(p[: int(s)].numpy()) for p, s in zip(parts, sizes, strict=True)]


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def _nccl_whole(rank: int, buf: torch.Tensor, repeats: int, gloo: Any) -> list[float]:
    """Seconds per raw send / recv of `buf`, on the receiver's clock from the sender's start."""
    out = []
    for _ in range(repeats + 1):  # the first sets NCCL's p2p channels up: not counted
        dist.barrier(group=gloo)
        _sync(buf)
        start = time.monotonic()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        _sync(buf)
        end = time.monotonic()
        starts = _exchange(json.dumps([start, end]).encode(), gloo)
        (s0, _), (_, e1) = (json.loads(x) for x in starts)
        out.append(e1 - s0)
    return out[1:]


class NixlPair:
    """rank 0's WRITEs into rank 1's registered cache; rank 1 waits for their notifications."""

    def __init__(self, rank: int, cache: torch.Tensor, gloo: Any) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.rank, self.cache, self.gloo = rank, cache, gloo
        self.agent = nixl_agent(f"rank{rank}", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(cache)
        meta = _exchange(self.agent.get_agent_metadata(), gloo)
        self.peer = self.agent.add_remote_agent(meta[1 - rank])
        addrs = _exchange(json.dumps([cache.data_ptr(), cache.device.index or 0]).encode(), gloo)
        self.peer_addr, self.peer_dev = json.loads(addrs[1 - rank])
        self.count = 0

    def _descs(self, base: int, dev: int, offsets: list[int], size: int) -> Any:
        kind = "VRAM" if self.cache.is_cuda else "DRAM"
        return self.agent.get_xfer_descs([(base + o, size, dev) for o in offsets], kind)

    def run(self, pieces: list[tuple[list[int], list[int], int]], repeats: int) -> list[float]:
        """Each repeat: WRITE every (source offsets, destination offsets, size) piece in order,
        one request a piece; seconds from the first post to the receiver holding the last
        notification."""
        out = []
        handles = []
        if self.rank == 0:
            me = self.cache.device.index or 0
            for src, dst, size in pieces:
                local = self._descs(self.cache.data_ptr(), me, src, size)
                remote = self._descs(self.peer_addr, self.peer_dev, dst, size)
                handles.append(self.agent.initialize_xfer("WRITE", local, remote, self.peer))
        for _ in range(repeats + 1):
            dist.barrier(group=self.gloo)
            start = time.monotonic()
            if self.rank == 0:
                for i, h in enumerate(handles):
                    tag = f"{self.count}:{i}".encode()
                    assert self.agent.transfer(h, tag) != "ERR", "NIXL refused the WRITE"
                while any(self.agent.check_xfer_state(h) == "PROC" for h in handles):
                    pass
                assert all(self.agent.check_xfer_state(h) == "DONE" for h in handles)
            else:
                last = f"{self.count}:{len(pieces) - 1}".encode()
                deadline = time.monotonic() + 30
                seen: set[bytes] = set()
                while last not in seen:
                    for msgs in self.agent.get_new_notifs().values():
                        seen.update(msgs)
                    assert time.monotonic() < deadline, "no notification in 30 s"
            end = time.monotonic()
            stamps = _exchange(json.dumps([start, end]).encode(), self.gloo)
            (s0, _), (_, e1) = (json.loads(x) for x in stamps)
            out.append(e1 - s0)
            self.count += 1
        for h in handles:
            self.agent.release_xfer_handle(h)
        return out[1:]


def _block_pieces(
    blocks: int, layer_wise: bool, run: int = 1
) -> list[tuple[list[int], list[int], int]]:
    """(layer, K/V, block) -> the same (layer, K/V) of the receiver's block `_dst_blocks` names;
    `run` blocks in a row go as one descriptor."""
    dst_block = _dst_blocks(blocks, run).tolist()
    per_layer = []
    for layer in range(LAYERS):
        src, dst = [], []
        for kv in range(2):
            plane = (layer * 2 + kv) * blocks * BLOCK_BYTES
            for b in range(0, blocks, run):
                src.append(plane + b * BLOCK_BYTES)
                dst.append(plane + dst_block[b] * BLOCK_BYTES)
        per_layer.append((src, dst, run * BLOCK_BYTES))
    if layer_wise:
        return per_layer
    size = run * BLOCK_BYTES
    return [([o for p in per_layer for o in p[0]], [o for p in per_layer for o in p[1]], size)]


def _dst_blocks(blocks: int, run: int) -> torch.Tensor:
    """[blocks] the receiver's block for each of the sender's: runs of `run` blocks in a row,
    the runs in shuffled order (run 1: every block shuffled)."""
    runs = torch.randperm(blocks // run, generator=torch.Generator().manual_seed(0))
    return (runs[:, None] * run + torch.arange(run)[None, :]).flatten()


def _digest(x: torch.Tensor) -> int:
    """A position-sensitive sum of x's int32 words (a block in the wrong place changes it)."""
    words = x.view(torch.int32).to(torch.int64)
    weights = torch.arange(words.numel(), device=x.device) % 65521 + 1
    return int((words * weights).sum().item())


def _checked(rank: int, cache: torch.Tensor, blocks: int, run: int, gloo: Any) -> bool:
    """The receiver's cache equals the sender's, block for block (run > 0: through the
    permutation the pieces of that run length used)."""
    view = cache
    if run and rank == 1:
        perm = _dst_blocks(blocks, run).to(cache.device)
        view = cache.view(LAYERS * 2, blocks, BLOCK_BYTES)[:, perm].flatten()
    both = _exchange(json.dumps(_digest(view)).encode(), gloo)
    return json.loads(both[0]) == json.loads(both[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--cpu", action="store_true", help="a dry run: gloo, host memory, 16 blocks"
    )
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    blocks = 16 if args.cpu else BLOCKS
    total = LAYERS * 2 * blocks * BLOCK_BYTES  # 512 MiB on GPUs
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        gloo = dist.group.WORLD
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        gloo = dist.new_group(backend="gloo")
    cache = torch.zeros(total, dtype=torch.uint8, device=device)
    if rank == 0:
        cache.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    results: dict[str, Any] = {}
    results["nccl_whole"] = {"seconds": _nccl_whole(rank, cache, args.repeats, gloo)}
    results["nccl_whole"]["bytes_ok"] = _checked(rank, cache, blocks, 0, gloo)
    try:
        pair = NixlPair(rank, cache, gloo)
        ways = {
            "nixl_whole": ([([0], [0], total)], 0),
            "nixl_blocks": (_block_pieces(blocks, False), 1),
            "nixl_layers": (_block_pieces(blocks, True), 1),
            "nixl_runs16": (_block_pieces(blocks, False, 16), 16),
            "nixl_runs16_layers": (_block_pieces(blocks, True, 16), 16),
            "nixl_planes": (_block_pieces(blocks, False, blocks), blocks),
        }
        for name, (pieces, shuffled) in ways.items():
            if rank == 1:
                cache.zero_()
            seconds = pair.run(pieces, args.repeats)
            results[name] = {"seconds": seconds,
                             "bytes_ok": _checked(rank, cache, blocks, shuffled, gloo)}  # fmt: skip
    except Exception as e:  # NIXL missing or failing here: say so, keep NCCL's figures
        results["nixl_error"] = f"{type(e).__name__}: {e}"[:400]
    if rank == 0:
        raw = statistics.median(results["nccl_whole"]["seconds"])
        for r in results.values():
            if isinstance(r, dict):
                s = statistics.median(r["seconds"])
                r.update(median_ms=round(s * 1e3, 3), gb_s=round(total / s / 1e9, 1),
                         vs_nccl=round(raw / s, 3))  # fmt: skip
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        report = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                  "bytes": total, "results": results}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nixl.json").write_text(json.dumps(report, indent=2))
        print("| way | median ms | GB/s | vs NCCL p2p | bytes |")
        print("| --- | --- | --- | --- | --- |")
        for name, r in results.items():
            if isinstance(r, dict):
                print(f"| {name} | {r['median_ms']} | {r['gb_s']} | {r['vs_nccl']} | "
                      f"{'ok' if r['bytes_ok'] else 'WRONG'} |")  # fmt: skip
            else:
                print(f"| {name} | {r} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
