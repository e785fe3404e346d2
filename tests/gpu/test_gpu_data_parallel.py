"""Data parallelism on two GPUs: DP=2 + EP=2 (data-parallel attention) replays CUDA graphs on
both replicas with steps launched ahead, an idle replica joins its peer's steps, greedy tokens
equal one GPU's and transformers' (fp32), and the engine closes quickly; dense DP=2 equals one
GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import close_seconds, generated_ids, hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
CLOSE_S = 2.0
CHILD_TIMEOUT_S = 180


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return generated_ids(llm, prompts, GREEDY)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_dp2_ep2_replays_graphs_and_matches_transformers(tiny_model, arch: str) -> None:
    """In a process of its own (dp_ep_child.py): the engine's NCCL group outlives it there."""
    folder = tiny_model(arch)
    prompts = random_prompts([5, 17, 40, 100, 9])
    child = Path(__file__).with_name("dp_ep_child.py")
    done = subprocess.run(
        [sys.executable, str(child), str(folder), "float32"],
        input=json.dumps(prompts),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["graphs"] and report["gather_scatter"] and report["all_to_all"] == 0
    # With graphs each replica launches its next step ahead of its tokens (async scheduling),
    # and the replicas agree on each step's size through shared memory (one machine).
    assert report["launched_ahead"] > 0 and report["host_max_shared"]
    assert report["per_replica"] == [4, 2]  # the lone request ran on replica 0, 1 idle
    hf = load_hf(folder)
    want = [hf_greedy(hf, p, GREEDY.max_tokens, ignore_eos=True) for p in prompts]
    assert report["tokens"] == want and report["alone"] == want[:1]
    assert report["close_s"] < CLOSE_S


def test_dense_dp2_equals_one_gpu(tiny_model) -> None:
    folder = str(tiny_model("llama"))
    prompts = random_prompts([7, 33, 64, 90, 5])
    one = LLM(folder, dtype="float32", kv_cache_tokens=4096)
    want = _tokens(one, prompts)
    one.close()
    del one
    llm = LLM(folder, dtype="float32", kv_cache_tokens=4096, data_parallel_size=2)
    assert _tokens(llm, prompts) == want
    assert close_seconds(llm) < CLOSE_S
