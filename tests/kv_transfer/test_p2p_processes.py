"""The `nccl` KV transport between two GPUs, as the mesh uses it: a sender on cuda:0 (this
process) and a receiver on cuda:1 (a process of its own); and `gloo` between two CPU processes.
Every byte is checked against the source: shuffled blocks on both sides, a prompt's cached
blocks at once (`send_layers`) and layer by layer (`send_blocks`, small frames that the sender
holds back and joins), a receiver holding some of the layers (a pipeline stage) and one holding
some of the heads (another TP size)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.timeout(300)
# The same test between two CPU processes over `gloo` (the same code as `nccl`), on any machine.
TRANSPORTS = [
    "gloo",
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
        ],
    ),
]

LAYERS, HEADS, DIM, BS, BLOCKS = 4, 2, 64, 16, 96

_RECEIVER = """
import json, sys, torch
from pdmesh.kv_transfer import PageGeometry, TransferSpec, create_receiver
transport = sys.argv[8]
layer_start, layers, head_start, heads, dim, bs, blocks = map(int, sys.argv[1:8])
device = "cuda:1" if transport == "nccl" else "cpu"
geo = PageGeometry(num_layers=layers, layer_start=layer_start, block_size=bs,
                   num_kv_heads=heads, head_start=head_start, head_dim=dim, dtype=torch.bfloat16)
cache = torch.zeros(geo.cache_shape(blocks), dtype=geo.dtype, device=device)
rx = create_receiver(transport, cache, geo, "tcp://127.0.0.1:0")
print(json.dumps({"endpoint": rx.endpoint}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    spec = TransferSpec(job["id"], bytes.fromhex(job["token"]), tuple(job["blocks"]),
                        head_start, heads)
    cache.zero_()
    done = rx.expect(spec, timeout=60)
    print(json.dumps({"expecting": job["id"]}), flush=True)
    stats = done.result(timeout=60)
    got = cache[:, :, job["blocks"]].cpu()
    # The source, made the same way on both sides: every global layer and head.
    full = torch.randn((job["layers"], 2, len(job["blocks"]), bs, job["heads"], dim),
                       generator=torch.Generator().manual_seed(job["seed"])).to(geo.dtype)
    want = full[layer_start:layer_start + layers, :, :, :, head_start:head_start + heads]
    print(json.dumps({"bytes": stats.bytes, "equal": bool(torch.equal(got, want)),
                      "untouched": int((cache[:, :, job["untouched"]] != 0).sum())}), flush=True)
rx.close()
"""


def _receiver(transport: str, layer_start: int, layers: int, head_start: int, heads: int):
    args = [layer_start, layers, head_start, heads, DIM, BS, BLOCKS + 32, transport]
    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["endpoint"]


def _ask(proc: subprocess.Popen, job: dict) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["expecting"] == job["id"]
    return job


def _answer(proc: subprocess.Popen) -> dict:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    "layers,heads,mode",
    [
        ((0, LAYERS), (0, HEADS), "whole"),
        ((0, LAYERS), (0, HEADS), "layers"),
        ((1, 2), (0, HEADS), "whole"),  # a pipeline stage's layers
        ((0, LAYERS), (1, 1), "layers"),  # another TP size's head
    ],
)
def test_pages_land_in_shuffled_blocks_byte_for_byte(transport, layers, heads, mode) -> None:
    import secrets

    from pdmesh.kv_transfer import PageGeometry, create_sender

    device = "cuda:0" if transport == "nccl" else "cpu"
    if transport == "nccl":
        torch.cuda.set_device(0)
    geo = PageGeometry(
        num_layers=LAYERS, block_size=BS, num_kv_heads=HEADS, head_start=0, head_dim=DIM,
        dtype=torch.bfloat16,
    )  # fmt: skip
    proc, endpoint = _receiver(transport, *layers, *heads)
    tx = create_sender(transport, geo)
    try:
        gen = torch.Generator().manual_seed(7)
        for seed in range(3):  # the first builds the pair; the others reuse it
            n = [BLOCKS, 40, 5][seed]
            order = torch.randperm(BLOCKS + 32, generator=gen).tolist()
            dst, untouched = order[:n], order[n:]
            src_ids = torch.randperm(BLOCKS + 32, generator=gen)[:n]
            full = torch.randn(
                (LAYERS, 2, n, BS, HEADS, DIM), generator=torch.Generator().manual_seed(seed)
            ).to(geo.dtype)
            source = torch.zeros(geo.cache_shape(BLOCKS + 32), dtype=geo.dtype)
            source[:, :, src_ids] = full
            source, src_ids = source.to(device), src_ids.to(device)
            job = {
                "id": secrets.token_hex(16), "token": secrets.token_hex(16), "blocks": dst,
                "untouched": untouched, "seed": seed, "layers": LAYERS, "heads": HEADS,
            }  # fmt: skip
            _ask(proc, job)
            h = tx.start(endpoint, job["id"], bytes.fromhex(job["token"]), n, heads, layers)
            if mode == "whole":
                tx.send_layers([h], 0, source, src_ids)
            else:
                for layer in range(LAYERS):
                    tx.send_blocks([h], layer, 0, source[layer], src_ids)
            sent = tx.finish(h, timeout=60)
            got = _answer(proc)
            expected = layers[1] * 2 * n * BS * heads[1] * DIM * 2
            assert sent.bytes == expected and got["bytes"] == expected
            assert got["equal"] and got["untouched"] == 0
    finally:
        tx.close()
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)
