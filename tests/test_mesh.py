"""The mesh as users meet it: `pdmesh up` processes on loopback, driven over gRPC."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from mesh_support import Mesh, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc

DISAGG_MIN = 64
# The small model (conftest): 4 layers x (K + V) x 16 tokens x 3 KV heads x 16 dims x 4 bytes.
BLOCK_BYTES = 4 * 2 * 16 * 3 * 16 * 4


@pytest.fixture(scope="module")
def mesh(small_model_folder: Path) -> Mesh:
    m = start_mesh(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--kv-cache-tokens",
        "32768",
        "--max-num-batched-tokens",
        "512",
        "--disagg-min-tokens",
        str(DISAGG_MIN),
        model=small_model_folder,
    )
    yield m
    m.stop()
    assert m.proc.returncode == 0, "".join(m.output[-30:])


def _request(prompt: list[int], max_tokens: int, **sampling: object) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt),
        sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0, **sampling),
    )


async def _generate(
    target: str, requests: list[gen_pb.GenerateRequest]
) -> list[list[gen_pb.GenerateResponse]]:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def one(req: gen_pb.GenerateRequest) -> list[gen_pb.GenerateResponse]:
            return [r async for r in stub.Generate(req)]

        return await asyncio.gather(*(one(r) for r in requests))


def test_concurrent_requests_match_offline_and_kv_bytes_are_exact(
    mesh: Mesh, small_llm: LLM
) -> None:
    rng = random.Random(11)
    vocab = small_llm.engine.info.vocab_size
    # 20 at once (32 until 2026-11-27: CI time); both sides of DISAGG_MIN, block edges included.
    lengths = [rng.choice([5, 20, 40, 63, 64, 90, 150, 300]) for _ in range(20)]
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
    before = mesh.stats(mesh.decode[0])
    streams = asyncio.run(_generate(mesh.target, [_request(p, 16) for p in prompts]))
    expected = small_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=16, temperature=0)
    )
    for stream, exp, prompt in zip(streams, expected, prompts, strict=True):
        tokens = [t for r in stream for t in r.token_ids]
        assert tokens == exp.outputs[0].token_ids
        assert "".join(r.text for r in stream) == exp.outputs[0].text
        last = stream[-1]
        assert last.finish_reason in (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)
        assert last.usage.prompt_tokens == len(prompt)
        assert last.timings.disaggregated == (len(prompt) >= DISAGG_MIN)
    after = mesh.stats(mesh.decode[0])
    remote = [n for n in lengths if n >= DISAGG_MIN]
    expected_bytes = sum(-(-n // 16) for n in remote) * BLOCK_BYTES
    assert after.kv_bytes_received - before.kv_bytes_received == expected_bytes
    assert after.remote_prefills - before.remote_prefills == len(remote)
    assert after.local_prefills - before.local_prefills == len(lengths) - len(remote)
    assert after.kv_blocks_used == 0
    assert mesh.stats(mesh.prefill[0]).kv_blocks_used == 0


def _positions(entries: list[gen_pb.PositionLogprobs]) -> list[dict[int, tuple[float, int]]]:
    return [
        {t: (lp, r) for t, lp, r in zip(e.token_ids, e.logprobs, e.ranks, strict=True)}
        for e in entries
    ]


def _expected(entries: list) -> list[dict[int, tuple[float, int]]]:
    return [{t: (e.logprob, e.rank) for t, e in p.items()} for p in entries]


def _assert_close(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)  # the same tokens, in the same order (the chosen one first)
        for t, (lp, rank) in g.items():
            # Batches differ (and so do fp32 sums): a sampled token deep in the vocabulary can
            # trade places with one whose logprob is equal to within the tolerance.
            assert abs(lp - w[t][0]) < 1e-4 and abs(rank - w[t][1]) <= 1


def test_logprobs_and_prompt_logprobs_through_the_mesh(mesh: Mesh, small_llm: LLM) -> None:
    """Prompts prefilled on the prefill worker (long) and on the decode worker (short): the
    first token's and the prompt's log-probabilities come back from where it was prefilled,
    equal to the offline engine's (itself checked against transformers in test_logprobs)."""
    rng = random.Random(5)
    vocab = small_llm.engine.info.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (100, 12)]
    sampling = [dict(temperature=0), dict(temperature=1.0, seed=7)]
    requests = [
        gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=p),
            sampling=gen_pb.SamplingParams(
                max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2, **s
            ),
        )
        for p in prompts
        for s in sampling
    ]
    streams = asyncio.run(_generate(mesh.target, requests))
    for req, stream in zip(requests, streams, strict=True):
        s = req.sampling
        params = SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            logprobs=3,
            prompt_logprobs=2,
            temperature=s.temperature,
            seed=s.seed if s.HasField("seed") else None,
        )
        out = small_llm.generate({"prompt_token_ids": list(req.token_ids.ids)}, params)[0]
        completion = out.outputs[0]
        assert [t for r in stream for t in r.token_ids] == completion.token_ids
        assert stream[-1].timings.disaggregated == (len(req.token_ids.ids) >= DISAGG_MIN)
        got = _positions([e for r in stream for e in r.logprobs])
        _assert_close(got, _expected(completion.logprobs))
        assert len(stream[0].prompt_logprobs) == len(req.token_ids.ids) - 1
        assert all(not r.prompt_logprobs for r in stream[1:])
        _assert_close(_positions(stream[0].prompt_logprobs), _expected(out.prompt_logprobs[1:]))
    assert mesh.stats(mesh.decode[0]).kv_blocks_used == 0


def _by_choice(stream: list[gen_pb.GenerateResponse]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for r in stream:
        tokens.setdefault(r.index, []).extend(r.token_ids)
    return tokens


def test_n_and_best_of_through_the_mesh(mesh: Mesh, small_llm: LLM) -> None:
    """n choices stream under their indexes, equal to the offline engine's (itself equal to
    separate requests seeded seed + i), with the prompt prefilled once, remotely for the long
    prompt; best_of sends the n best whole; every block is free afterwards."""
    rng = random.Random(6)
    vocab = small_llm.engine.info.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in (90, 20)]
    shapes = [dict(n=3), dict(n=2, best_of=3)]
    cases = [(p, shape) for p in prompts for shape in shapes]
    requests = [
        gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=p),
            sampling=gen_pb.SamplingParams(
                max_tokens=10, temperature=1.0, seed=21, ignore_eos=True, logprobs=1, **shape
            ),
        )
        for p, shape in cases
    ]
    before = mesh.stats(mesh.decode[0])
    streams = asyncio.run(_generate(mesh.target, requests))
    after = mesh.stats(mesh.decode[0])
    assert after.remote_prefills - before.remote_prefills == len(shapes)  # once per request
    # The choices shared the prompt's blocks; each partly filled last block was copied.
    assert after.fork_blocks_shared > before.fork_blocks_shared
    assert after.fork_blocks_copied > before.fork_blocks_copied
    for (prompt, shape), stream in zip(cases, streams, strict=True):
        params = SamplingParams(
            max_tokens=10, temperature=1.0, seed=21, ignore_eos=True, logprobs=1, **shape
        )
        out = small_llm.generate({"prompt_token_ids": prompt}, params)[0]
        got = _by_choice(stream)
        assert got == {c.index: c.token_ids for c in out.outputs}
        for c in out.outputs:
            entries = [e for r in stream if r.index == c.index for e in r.logprobs]
            _assert_close(_positions(entries), _expected(c.logprobs))
        finishes = [(r.index, r.finish_reason) for r in stream if r.finish_reason]
        assert sorted(finishes) == [(i, gen_pb.FINISH_REASON_LENGTH) for i in range(shape["n"])]
        assert [r.HasField("usage") for r in stream].count(True) == 1 and stream[-1].usage
        assert stream[-1].usage.completion_tokens == 10 * shape["n"]
        if "best_of" in shape:  # not streamed: each choice arrives whole
            assert all(len(r.token_ids) == 10 for r in stream)
    assert mesh.stats(mesh.decode[0]).kv_blocks_used == 0
    assert mesh.stats(mesh.prefill[0]).kv_blocks_used == 0


def test_choices_ending_at_different_steps_through_the_mesh(mesh: Mesh, small_llm: LLM) -> None:
    """A choice that stops early ends only itself: the others stream on to their end, and the
    request's last chunk (with usage) comes after every choice's finish reason."""
    rng = random.Random(8)
    prompt = [rng.randrange(100, small_llm.engine.info.vocab_size) for _ in range(90)]
    params = dict(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, n=3)
    free = small_llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params))[0]
    tokens = [c.token_ids for c in free.outputs]
    stop = next(t for t in tokens[0][1:] if t not in tokens[1] and t not in tokens[2])
    sampling = gen_pb.SamplingParams(**params, stop_token_ids=[stop])
    request = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=sampling)
    (stream,) = asyncio.run(_generate(mesh.target, [request]))
    expected = small_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(**params, stop_token_ids=[stop])
    )[0]
    assert _by_choice(stream) == {c.index: c.token_ids for c in expected.outputs}
    assert len(expected.outputs[0].token_ids) < 10 == len(expected.outputs[1].token_ids)
    finishes = [(r.index, r.finish_reason) for r in stream if r.finish_reason]
    stop_pb, length_pb = gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH
    assert finishes == [(0, stop_pb), (1, length_pb), (2, length_pb)]
    assert stream[-1].usage.completion_tokens == sum(len(t) for t in _by_choice(stream).values())
    assert stream[-1].timings.disaggregated
    assert mesh.blocks_used() == (0, 0)


def test_n_beyond_what_the_kv_cache_can_hold_is_refused(mesh: Mesh) -> None:
    request = _request([5] * 10, 8000, n=16)
    with pytest.raises(grpc.RpcError) as caught:
        asyncio.run(_generate(mesh.target, [request]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n" in caught.value.details()


def test_reflection_and_health(mesh: Mesh) -> None:
    expected = {
        mesh.target: "pdmesh.v1.Generation",
        mesh.prefill[0]: "pdmesh.v1.PrefillWorker",
        mesh.decode[0]: "pdmesh.v1.DecodeWorker",
    }
    for address, service in expected.items():
        with grpc.insecure_channel(address) as ch:
            services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
            assert {service, "grpc.health.v1.Health"} <= services
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_model_info_and_tokenize(mesh: Mesh, small_llm: LLM, small_model_folder: Path) -> None:
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        info = stub.GetModelInfo(gen_pb.ModelInfoRequest(), timeout=5)
        assert info.name == small_model_folder.name and info.vocab_size == 49152
        assert (info.num_prefill_workers, info.num_decode_workers) == (1, 1)
        tok = stub.Tokenize(gen_pb.TokenizeRequest(text="Hello world"), timeout=5)
        assert list(tok.token_ids) == small_llm.get_tokenizer().encode("Hello world")


def test_cancel_mid_stream_frees_decode_blocks(mesh: Mesh) -> None:
    prompt = list(range(1000, 1300))
    with grpc.insecure_channel(mesh.target) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(
            _request(prompt, 4000, ignore_eos=True)
        )
        for i, _ in enumerate(call):
            if i == 3:
                break
        assert mesh.blocks_used()[0] > 0
        call.cancel()
        mesh.wait_blocks_free(5.0)  # generous: two pytest workers may share the cores


def test_cancel_during_remote_prefill_frees_prefill_blocks(mesh: Mesh) -> None:
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(4000)]
    with grpc.insecure_channel(mesh.target) as ch:
        future = generation_pb2_grpc.GenerationStub(ch).Generate(_request(prompt, 8))
        deadline = time.monotonic() + 30
        while mesh.stats(mesh.prefill[0]).kv_blocks_used == 0:  # the prefill is under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
        future.cancel()
        # The abort lands between steps: after the prefill chunk under way, which on two CPU
        # cores shared with the router and the decode worker can itself take about a second.
        mesh.wait_blocks_free(10.0)


def test_deadline_frees_blocks(mesh: Mesh) -> None:
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Generate(
                _request(list(range(2000, 2200)), 4000, ignore_eos=True), timeout=2.0
            ):
                pass
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    mesh.wait_blocks_free(5.0)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"text": ""}, "prompt must not be empty"),
        ({"token_ids": gen_pb.TokenIds(ids=[1] * 9000)}, "max_model_len"),
        ({"token_ids": gen_pb.TokenIds(ids=[1, 10**6])}, "token ids must be in"),
        ({"text": "hi", "sampling": gen_pb.SamplingParams(temperature=-1)}, "temperature"),
        ({"text": "hi", "sampling": gen_pb.SamplingParams(top_p=2)}, "top_p"),
        ({"text": "hi", "sampling": gen_pb.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"text": "hi", "model": "gpt-4"}, "model"),
        ({}, "input must be one of"),
    ],
)
def test_bad_requests_are_invalid_argument(mesh: Mesh, request_kwargs: dict, field: str) -> None:
    with grpc.insecure_channel(mesh.target) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gen_pb.GenerateRequest(**request_kwargs), timeout=30))
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        ok = list(stub.Generate(_request([1, 2, 3], 4), timeout=60))
        assert sum(len(r.token_ids) for r in ok) == 4
