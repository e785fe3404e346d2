"""Tensor- and pipeline-parallel workers in the mesh: KV re-split across layouts, and a rank
dying."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mesh_support import assert_layouts_crossed, greedy_tokens, start_mesh
from support import running

from pdmesh import LLM, SamplingParams

PARAMS = dict(max_tokens=12, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(512) for _ in range(rng.randint(40, 150))] for _ in range(6)]


@pytest.mark.parametrize(
    ("prefill", "decode", "transport"),
    [
        ((1, 1), (2, 1), "tcp"),
        # each decode stage receives its own layers, both heads of them on its one rank (TP=2
        # into TP=1 alone was a case of its own until 2026-11-27: CI time)
        ((2, 1), (1, 2), "gloo"),
        # each prefill stage (of two TP ranks) sends its own layers; PP=2 alone on the prefill
        # side is this case's (a case of its own until 2026-11-27: CI time)
        ((2, 2), (2, 1), "tcp"),
    ],
    ids=["tp1-tp2", "tp2-pp2-gloo", "tp2xpp2-tp2"],
)
def test_kv_crosses_layouts(
    tiny_model, prefill: tuple[int, int], decode: tuple[int, int], transport: str
) -> None:
    """Prefill and decode workers of different (TP, PP) layouts: each rank sends its own heads
    of its own layers straight to the decode ranks holding them, each byte once."""
    folder = str(tiny_model("llama"))  # 2 KV heads: TP 2 holds one per rank; 2 layers
    prompts = _prompts()
    offline = LLM(folder, kv_cache_tokens=4096).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**PARAMS)
    )
    layouts = []
    for role, (tp, pp) in (("prefill", prefill), ("decode", decode)):
        layouts += [f"--{role}-tp", str(tp), f"--{role}-pp", str(pp)]
    mesh = start_mesh(
        "--model",
        folder,
        *layouts,
        "--kv-cache-tokens",
        "4096",
        "--disagg-min-tokens",
        "16",
        "--kv-transport",
        transport,
    )
    try:
        assert asyncio.run(greedy_tokens(mesh.target, prompts, PARAMS["max_tokens"])) == [
            o.outputs[0].token_ids for o in offline
        ]
        assert_layouts_crossed(mesh, prompts, prefill, decode)
    finally:
        mesh.stop()


def _followers(pid: int) -> list[int]:
    """The tensor-parallel follower processes started by worker `pid`."""
    return running("pdmesh.engine.executor.follower", pid)


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_killing_one_rank_takes_its_worker_out(tiny_model) -> None:
    folder = str(tiny_model("llama"))
    mesh = start_mesh(
        "--model",
        folder,
        "--prefill",
        "0",
        "--decode",
        "2",
        "--colocated",
        "--decode-tp",
        "2",
        "--kv-cache-tokens",
        "4096",
    )
    try:
        doomed, healthy = mesh.decode
        followers = _followers(mesh.pids[doomed])
        assert len(followers) == 1
        os.kill(followers[0], signal.SIGKILL)
        start = time.monotonic()
        while _serving(doomed):
            assert time.monotonic() - start < 30, "the worker kept serving with a dead rank"
            time.sleep(0.2)
        # The worker process itself exits too (with its remaining ranks), within 30 s.
        while _pid_alive(mesh.pids[doomed]):
            assert time.monotonic() - start < 30, "the worker did not exit"
            time.sleep(0.2)
        # New requests go to the healthy worker (the dead one is restarted by `pdmesh up` after
        # a back-off, and rejoins only once healthy); nothing hangs.
        out = asyncio.run(greedy_tokens(mesh.target, _prompts()[:3], PARAMS["max_tokens"]))
        assert all(len(o) == PARAMS["max_tokens"] for o in out)
        assert mesh.stats(healthy).local_prefills >= 1
    finally:
        mesh.stop()


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
