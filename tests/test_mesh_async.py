"""A mesh whose decode worker runs async scheduling (the GPU default), forced on here on the
CPU: streamed tokens equal the offline engine's, requests prefilled remotely join a batch that
is running ahead, and a cancelled stream's blocks come back."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
from mesh_support import greedy_tokens, start_mesh

from pdmesh import LLM, SamplingParams
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.v1 import generation_pb2_grpc


def test_async_decode_worker_streams_the_offline_tokens(
    small_llm: LLM, small_model_folder: Path
) -> None:
    mesh = start_mesh(
        "--prefill",
        "1",
        "--decode",
        "1",
        "--async-scheduling",
        "--kv-cache-tokens",
        "16384",
        "--max-num-batched-tokens",
        "256",
        "--disagg-min-tokens",
        "64",
        model=small_model_folder,
    )
    try:
        rng = random.Random(21)
        vocab = small_llm.engine.info.vocab_size
        # Short prompts prefill on the decode worker, long ones on the prefill worker; they
        # arrive while earlier ones decode.
        lengths = [5, 120, 30, 200, 12, 90, 64, 7, 150, 40]
        prompts = [[rng.randrange(100, vocab) for _ in range(n)] for n in lengths]
        got = asyncio.run(greedy_tokens(mesh.target, prompts, 20))
        want = small_llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        )
        assert got == [w.outputs[0].token_ids for w in want]
        stats = mesh.stats(mesh.decode[0])
        assert stats.steps_launched_ahead > 0
        assert stats.remote_prefills == sum(n >= 64 for n in lengths)
        mesh.wait_blocks_free(8.0)

        with grpc.insecure_channel(mesh.target) as ch:  # cancelled while steps run ahead
            call = generation_pb2_grpc.GenerationStub(ch).Generate(
                gen_pb.GenerateRequest(
                    token_ids=gen_pb.TokenIds(ids=prompts[1]),
                    sampling=gen_pb.SamplingParams(max_tokens=4000, ignore_eos=True),
                )
            )
            for i, _ in enumerate(call):
                if i == 5:
                    break
            call.cancel()
        mesh.wait_blocks_free(8.0)
    finally:
        mesh.stop()
    assert mesh.proc.returncode == 0, "".join(mesh.output[-30:])
