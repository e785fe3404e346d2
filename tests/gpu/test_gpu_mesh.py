"""The mesh on two GPUs with the default KV transport (`auto`: `nccl` between workers on
different GPUs): prefill worker on cuda:0, decode worker on cuda:1, the KV pages going GPU to
GPU. Outputs equal the single-GPU engine's; every byte is counted on both ends; a decode worker
killed mid-stream leaves the prefill worker serving, and once `pdmesh up` has restarted it, the
pair to the new decode worker carries KV again. On three and four GPUs, prefill and decode workers
of different layouts (PP=2 into TP=1 and the reverse, TP=2 into TP=1, TP=2 into PP=2): each rank
sends its own heads of its own layers GPU to GPU, and the output still equals one GPU's."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time
import urllib.request

import grpc
import pytest
import torch
from mesh_support import Mesh, assert_layouts_crossed, greedy_tokens, start_mesh
from service_support import wait_workers

from pdmesh import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

PARAMS = dict(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(20, 150))] for _ in range(8)]


def _kv_bytes_by_transport(mesh: Mesh, worker: str) -> dict[str, float]:
    """pdmesh_kv_transfer_bytes_total by transport, from the worker's /metrics."""
    url = next(
        m.group(1)
        for line in mesh.output
        if (m := re.match(rf"\s+{worker}: .* metrics (\S+)", line))
    )
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.findall(r'pdmesh_kv_transfer_bytes_total\{.*transport="(\w+)"\} (\S+)', text)
    return {transport: float(value) for transport, value in found}


def test_nccl_mesh_equals_one_gpu_and_survives_a_dead_decode_worker(tiny_model) -> None:
    folder = str(tiny_model("llama"))
    reference = LLM(folder, dtype="float32", kv_cache_tokens=8192)

    def expected(prompts: list[list[int]]) -> list[list[int]]:
        outs = reference.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(**PARAMS)
        )
        return [o.outputs[0].token_ids for o in outs]

    mesh = start_mesh(
        "--model",
        folder,
        "--dtype",
        "float32",
        "--kv-cache-tokens",
        "8192",
        "--disagg-min-tokens",
        "16",
    )
    try:
        prompts = _prompts(1)
        assert asyncio.run(greedy_tokens(mesh.target, prompts, 24)) == expected(prompts)
        d, p = mesh.stats(mesh.decode[0]), mesh.stats(mesh.prefill[0])
        assert d.remote_prefills == len(prompts) and d.prefill_fallbacks == 0
        block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers x (K+V) x tokens x KV heads x dims x fp32
        blocks = sum(-(-len(x) // 16) for x in prompts)
        assert d.kv_bytes_received == p.kv_bytes_sent == blocks * block_bytes
        assert d.kv_blocks_used == 0
        assert _kv_bytes_by_transport(mesh, "decode-0") == {"nccl": blocks * block_bytes}

        # Kill the decode worker while it streams long outputs.
        victim = mesh.decode[0]

        async def kill_mid_stream() -> None:
            task = asyncio.ensure_future(greedy_tokens(mesh.target, _prompts(2), 400))
            await asyncio.sleep(1.0)
            os.kill(mesh.pids[victim], signal.SIGKILL)
            await asyncio.gather(task, return_exceptions=True)

        asyncio.run(kill_mid_stream())
        # The prefill worker stays up and healthy while the decode worker is gone.
        assert mesh.stats(mesh.prefill[0]).kv_bytes_sent >= p.kv_bytes_sent
        deadline = time.monotonic() + 180  # `pdmesh up` restarts it at the same address
        while True:
            try:
                if mesh.stats(victim).kv_blocks_total > 0:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "the decode worker was not restarted"
            time.sleep(0.5)
        wait_workers(mesh.target, 1, 1, timeout_s=120)
        prompts = _prompts(3)
        assert asyncio.run(greedy_tokens(mesh.target, prompts, 24)) == expected(prompts)
        d = mesh.stats(victim)
        assert d.remote_prefills == len(prompts) and d.prefill_fallbacks == 0
    finally:
        mesh.stop()


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 1), (1, 1)), ((2, 1), (1, 2))],
    ids=["pp2-tp1", "tp1-pp2", "tp2-tp1", "tp2-pp2"],
)
def test_nccl_mesh_of_mixed_layouts_equals_one_gpu(
    tiny_model, prefill: tuple[int, int], decode: tuple[int, int]
) -> None:
    gpus = prefill[0] * prefill[1] + decode[0] * decode[1]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    folder = str(tiny_model("llama"))  # 2 KV heads, 2 layers: a head and a layer a rank
    prompts = _prompts(4)
    outs = LLM(folder, dtype="float32", kv_cache_tokens=8192).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**PARAMS)
    )
    layouts = []
    for role, (tp, pp) in (("prefill", prefill), ("decode", decode)):
        layouts += [f"--{role}-tp", str(tp), f"--{role}-pp", str(pp)]
    mesh = start_mesh(
        *["--model", folder, "--dtype", "float32", "--kv-cache-tokens", "8192", *layouts],
        *["--disagg-min-tokens", "16"],
    )
    try:
        got = asyncio.run(greedy_tokens(mesh.target, prompts, PARAMS["max_tokens"]))
        assert got == [o.outputs[0].token_ids for o in outs]
        assert_layouts_crossed(mesh, prompts, prefill, decode)
        assert set(_kv_bytes_by_transport(mesh, "decode-0")) == {"nccl"}
    finally:
        mesh.stop()
