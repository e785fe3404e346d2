"""`--kv-cache-dtype fp8` across worker processes: a prefill worker pushes fp8 blocks over tcp to
a decode worker of the same cache dtype (the offline fp8 engine's tokens, one byte an element
counted), and a prefill worker with a cache of another dtype is refused rather than read: the
decode worker computes the prompt itself and gives the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from mesh_support import free_port
from service_support import Service, decode_via, wait_until

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.timeout(240)

PARAMS = dict(max_tokens=6, temperature=0, ignore_eos=True)
# The tiny llama: 2 layers x (K + V) x 16 tokens x 2 KV heads x 16 dims, one byte each.
FP8_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16


@dataclass
class Workers:
    fp8: Service  # prefill, --kv-cache-dtype fp8
    fp32: Service  # prefill, the default (the model's dtype)
    decode: Service  # --kv-cache-dtype fp8
    reference: LLM  # offline, fp8 cache


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    folder = str(tiny_model("llama"))
    logs = tmp_path_factory.mktemp("logs")
    engine = ["--model", folder, "--kv-cache-tokens", "4096"]
    fp8 = ["--kv-cache-dtype", "fp8"]

    def service(role: str, name: str, *extra: str) -> Service:
        argv = ["--port", str(free_port()), "--metrics-port", str(free_port()), *engine, *extra]
        return Service(role, argv, logs / f"{name}.log")

    services = [
        service("prefill", "prefill-fp8", *fp8),
        service("prefill", "prefill-fp32"),
        service("decode", "decode-fp8", *fp8, "--kv-timeout", "20"),
    ]
    try:
        for s in services:
            s.start()
        for s in services:
            s.wait_serving()
        yield Workers(*services, LLM(folder, kv_cache_tokens=4096, kv_cache_dtype="fp8"))
    finally:
        for s in services:
            s.stop()


def test_fp8_blocks_move_between_workers_and_a_mismatch_is_recomputed(workers: Workers) -> None:
    prompts = [[(seed * 7919 + i * 104729) % 512 for i in range(80)] for seed in (1, 2)]
    outputs = workers.reference.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**PARAMS)
    )
    expected = [o.outputs[0].token_ids for o in outputs]

    got = decode_via(workers.decode, workers.fp8, "via-fp8", prompts[0], PARAMS)
    assert got == expected[0]
    d = workers.decode.stats()
    assert d.remote_prefills == 1 and d.prefill_fallbacks == 0
    assert d.kv_bytes_received == len(prompts[0]) // 16 * FP8_BLOCK_BYTES

    # fp32 frames into an fp8 cache: refused, nothing written; computed on the decode worker.
    got = decode_via(workers.decode, workers.fp32, "via-fp32", prompts[1], PARAMS)
    assert got == expected[1]
    d = workers.decode.stats()
    assert d.prefill_fallbacks == 1
    assert d.kv_bytes_received == len(prompts[0]) // 16 * FP8_BLOCK_BYTES  # none more
    wait_until(lambda: workers.decode.stats().kv_blocks_used == 0, 5, "blocks are free")
    assert "kv_cache_dtype" in workers.decode.log.read_text()  # the reason, in the warning
