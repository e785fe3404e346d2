"""Live migration: a decode worker drained mid-stream (SIGTERM with --drain-on-sigterm, or
`pdmesh drain`) hands its running requests, with their KV, to another decode worker; every
client stream goes on with no token missing or repeated and no recompute, equal to an
undisturbed run (greedy, seeded, penalties with logprobs, a grammar); no block stays in use;
the drained worker exits cleanly. A hand-over whose KV push fails falls back to a recompute on
the target, with the same output."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from service_support import Service, router_workers, wait_until, wait_workers

from pdmesh import LLM, SamplingParams
from pdmesh.processes import free_port
from pdmesh.sampling_params import StructuredOutputsParams
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

pytestmark = pytest.mark.timeout(150)

MAX_TOKENS = 400
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
# State that shapes sampling: penalties over the output so far, and logprobs; a grammar whose
# next token depends on where its matcher is.
SHAPED = dict(
    max_tokens=MAX_TOKENS,
    temperature=0,
    min_tokens=MAX_TOKENS,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logprobs=2,
)
GRAMMAR = dict(max_tokens=MAX_TOKENS, temperature=0, min_tokens=MAX_TOKENS)
REGEX = "(t1t2t3)+"


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory) -> str:
    # The tiny model with an EOS token (a grammar needs one to end on).
    copy = tmp_path_factory.mktemp("tiny-eos")
    for f in Path(tiny_model("llama")).iterdir():
        shutil.copy(f, copy / f.name)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    return str(copy)


class Pair:
    """A router and two decode workers (no prefill pool): `source` is drained, `target` takes
    its requests."""

    def __init__(self, folder: str, logs: Path, source_flags: list[str], target_flags: list[str]):
        engine = ["--model", folder, "--kv-cache-tokens", "8192"]
        self.source = Service(
            "decode", ["--port", str(free_port()), *engine, *source_flags], logs / "source.log"
        )
        self.target = Service(
            "decode", ["--port", str(free_port()), *engine, *target_flags], logs / "target.log"
        )
        decode = f"{self.source.address},{self.target.address}"
        self.router = Service(
            "router",
            ["--port", str(free_port()), "--http-port", "0", "--decode", decode, "--model", folder],
            logs / "router.log",
        )
        self.services = [self.source, self.target, self.router]

    def __enter__(self) -> Pair:
        for s in self.services:
            s.start()
        for s in self.services:
            s.wait_serving()
        wait_workers(self.router.address, 0, 2)
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.services:
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)  # a frozen worker must hear the stop
            s.stop()

    def freeze(self, s: Service) -> None:
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGSTOP)

    def thaw(self, s: Service) -> None:
        assert s.proc is not None
        os.kill(s.proc.pid, signal.SIGCONT)

    def workers_in_rotation(self, n: int) -> None:
        wait_until(lambda: router_workers(self.router.address) == (0, n), 15, f"{n} in rotation")


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(20, 80))] for _ in range(n)]


def _request(prompt: list[int], kind: dict) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(**kind)
    )
    if kind is GRAMMAR:
        req.sampling.structured_outputs.regex = REGEX
    return req


def _reference_params(kind: dict) -> SamplingParams:
    if kind is GRAMMAR:
        return SamplingParams(**kind, structured_outputs=StructuredOutputsParams(regex=REGEX))
    return SamplingParams(**kind)


async def _streams_moved(pair: Pair, prompts: list[list[int]], kinds: list[dict], drain) -> list:
    """Run the requests on `pair.source` alone (the target frozen, out of the rotation), then
    with every stream under way: the source frozen, the target back, `drain()` and the source
    thawed. The streams' responses."""
    streams: list[list[gen_pb.GenerateResponse]] = [[] for _ in prompts]
    pair.freeze(pair.target)
    pair.workers_in_rotation(1)
    async with grpc.aio.insecure_channel(pair.router.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(i: int) -> None:
            async for r in stub.Generate(_request(prompts[i], kinds[i]), timeout=120):
                streams[i].append(r)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        while min(sum(len(r.token_ids) for r in s) for s in streams) < 5:
            await asyncio.sleep(0.002)
        pair.freeze(pair.source)
        for s in streams:  # every stream is still running on the source
            assert sum(len(r.token_ids) for r in s) < MAX_TOKENS
        await asyncio.to_thread(pair.workers_in_rotation, 0)
        pair.thaw(pair.target)
        await asyncio.to_thread(pair.workers_in_rotation, 1)
        await asyncio.to_thread(drain)
        await asyncio.gather(*tasks)
    return streams


def _check_outputs(folder: str, streams: list, prompts: list, kinds: list) -> None:
    reference = LLM(folder, kv_cache_tokens=8192)
    for stream, prompt, kind in zip(streams, prompts, kinds, strict=True):
        expected = reference.generate([{"prompt_token_ids": prompt}], _reference_params(kind))[0]
        assert [t for r in stream for t in r.token_ids] == expected.outputs[0].token_ids
        assert "".join(r.text for r in stream) == expected.outputs[0].text
        if kind is SHAPED:  # every token streamed has its logprobs once, across the move
            assert sum(len(r.logprobs) for r in stream) == MAX_TOKENS
        last = stream[-1]
        assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            len(prompt),
            MAX_TOKENS,
        )


def test_sigterm_migrates_eight_streams_with_their_kv(folder: str, tmp_path: Path) -> None:
    prompts = _prompts(8)
    kinds = [GREEDY, SEEDED, GREEDY, SEEDED, GREEDY, SEEDED, SHAPED, GRAMMAR]
    with Pair(folder, tmp_path, ["--drain-on-sigterm"], []) as pair:
        source = pair.source.proc
        assert source is not None

        def drain() -> None:
            source.send_signal(signal.SIGTERM)  # handled once thawed
            pair.thaw(pair.source)

        streams = asyncio.run(_streams_moved(pair, prompts, kinds, drain))
        assert source.wait(30) == 0  # the drained worker exits cleanly
        log = pair.source.log.read_text()
        assert not [line for line in log.splitlines() if line.startswith("ERROR")], log[-3000:]
        target = pair.target.stats()
        # Every request continued with its KV: nothing prefilled or recomputed on the target.
        assert (target.migrations_in, target.migration_fallbacks) == (8, 0)
        assert target.local_prefills == target.remote_prefills == 0
        assert target.migration_bytes_received > 0
        wait_until(lambda: pair.target.stats().kv_blocks_used == 0, 5, "no block held")
    _check_outputs(folder, streams, prompts, kinds)


def test_failed_push_falls_back_to_recompute(folder: str, tmp_path: Path) -> None:
    prompts = _prompts(3)
    kinds = [GREEDY, SEEDED, SHAPED]
    # The target's KV data plane is advertised where nothing listens: every push fails.
    dead = ["--kv-advertise", f"127.0.0.1:{free_port()}", "--kv-timeout", "2"]
    with Pair(folder, tmp_path, [], dead) as pair:
        drained: list[subprocess.CompletedProcess[str]] = []

        def drain() -> None:
            cmd = [sys.executable, "-m", "pdmesh.cli", "drain", pair.source.address]
            pair.thaw(pair.source)
            drained.append(subprocess.run(cmd, capture_output=True, text=True, timeout=60))

        streams = asyncio.run(_streams_moved(pair, prompts, kinds, drain))
        (done,) = drained
        assert done.returncode == 0, done.stderr
        assert "0 requests migrated with their KV, 3 recomputed" in done.stdout
        # `pdmesh drain` leaves the worker up, idle and out of the rotation.
        assert not pair.source.serving()
        source = pair.source.stats()
        assert source.draining and source.kv_blocks_used == 0
        assert (source.migrations_out, source.migration_fallbacks) == (0, 3)
        target = pair.target.stats()
        assert (target.migrations_in, target.migration_fallbacks) == (0, 3)
        wait_until(lambda: pair.target.stats().kv_blocks_used == 0, 5, "no block held")
        assert router_workers(pair.router.address) == (0, 1)
    _check_outputs(folder, streams, prompts, kinds)
