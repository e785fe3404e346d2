"""The engine on a GPU: Triton kernels, CUDA graphs, bf16. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from support import hf_greedy, load_hf, random_prompts

from pdmesh import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_fp32_on_cuda_matches_transformers(tiny_model, arch: str) -> None:
    folder = tiny_model(arch)
    prompts = random_prompts([5, 17, 40, 100, 150, 3])
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=64)
    assert llm.engine.runner.graphs is not None  # decode steps replay CUDA graphs
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24, ignore_eos=True)


def test_batch1_decode_on_the_gemv_kernel_matches_transformers(tiny_model) -> None:
    """One sequence at a time, so each decode step's projections (and the MLP's activation)
    run on the GEMV kernel inside the graph; each step launched before the previous one's
    token is read (async scheduling, on by default with graphs)."""
    from torch.profiler import ProfilerActivity, profile

    folder = tiny_model("llama")
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=4096)
    assert llm.engine.async_scheduling
    hf = load_hf(folder)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        outputs = [
            llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in random_prompts([5, 40, 100])
        ]
    kernels = {e.key for e in prof.key_averages()}
    assert any("_gemv_kernel" in k for k in kernels), sorted(kernels)
    for prompt, out in zip(random_prompts([5, 40, 100]), outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24, ignore_eos=True)
    assert llm.engine.steps_launched_ahead >= 3 * 22


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_programmatic_dependent_launch_matches_transformers(tiny_model, monkeypatch, arch) -> None:
    """PDMESH_PDL=1 (the default): the decode path's kernels launched while the kernel before
    them finishes (each waits before reading what that kernel wrote), in graphs and eager, batch
    1 (GEMVs, the MoE GEMVs) and batched; tokens equal to transformers'."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("PDMESH_PDL", "1")
    folder = tiny_model(arch)
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=64)
    hf = load_hf(folder)
    prompts = random_prompts([5, 17, 40, 100])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)
    assert any("_gemv_kernel" in e.key for e in prof.key_averages())
    outputs = one + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24, ignore_eos=True)


def test_cuda_graphs_equal_eager(tiny_model) -> None:
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 33, 64, 90])]
    eager = LLM(folder, dtype="float32", kv_cache_tokens=4096, enforce_eager=True)
    graphs = LLM(folder, dtype="float32", kv_cache_tokens=4096)
    assert eager.engine.runner.graphs is None
    a = [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY)]
    b = [o.outputs[0].token_ids for o in graphs.generate(prompts, GREEDY)]
    assert a == b


def _compiled_variants() -> dict[str, int]:
    """How many variants Triton has compiled of each of pdmesh's kernels, on every device."""
    import sys

    from triton.runtime.jit import JITFunction

    import pdmesh.kernels.triton  # noqa: F401  (every kernel module, imported)

    counts = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("pdmesh.kernels.triton."):
            continue
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                counts[f"{module_name}.{name}"] = sum(len(c[0]) for c in fn.device_caches.values())
    return counts


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_no_kernel_is_compiled_mid_step(tiny_model, arch: str) -> None:
    """A Triton compile in the middle of a step held rank 0's host for 0.5-0.7 s on an H100. Every
    variant of the kernels a step can launch is compiled when the engine starts (its warm-up and
    its CUDA graphs): prompts of 1 to 460 tokens chunked into mixed steps (decode rows beside
    prefill rows, block tables 1 to 32 wide, one split or several) compile nothing more."""
    folder = tiny_model(arch)
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_tokens=16384, max_num_batched_tokens=96)
    started = _compiled_variants()
    prompts = random_prompts([1, 5, 16, 17, 33, 100, 250, 400, 460])
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)
    # Prompts arriving one by one while others decode: steps of 1 to 11 decode rows beside a
    # prefill, so each field of the step's inputs lands at many offsets (before they were
    # aligned, each new offset compiled prefill attention anew on a served decode worker).
    engine = llm.engine
    for k, prompt in enumerate(random_prompts([3 + 5 * k for k in range(11)], seed=9)):
        engine.add_request(f"arrival-{k}", prompt, params)
        engine.step()
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    compiled = _compiled_variants()
    assert {k: v - started.get(k, 0) for k, v in compiled.items() if v != started.get(k, 0)} == {}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("way", ["auto", "staged", "two_shot"])
def test_tp2_decode_graphs_equal_one_gpu(tiny_model, monkeypatch, way: str) -> None:
    """TP=2 on two GPUs replays decode graphs on both ranks (all-reduces over symmetric memory,
    the input copied in by the all-reduce kernel or staged before it; two_shot: the two-shot
    kernel from 1 KiB, so from 4 rows of this model on) and gives the single GPU's greedy
    tokens."""
    monkeypatch.setenv("PDMESH_ALL_REDUCE", "auto" if way == "two_shot" else way)
    if way == "two_shot":
        monkeypatch.setenv("PDMESH_TWO_SHOT_BYTES", "1024")
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 33, 64, 90, 5])]
    one = LLM(folder, dtype="float32", kv_cache_tokens=4096)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    del one
    tp = LLM(folder, dtype="float32", kv_cache_tokens=4096, tensor_parallel_size=2)
    assert tp.engine.runner.graphs is not None
    assert tp.engine.runner.tp.fast["all_reduce"].copy_in_kernel == (way != "staged")
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY)] == want


def test_bf16_default_model_answers(default_model_folder) -> None:
    llm = LLM(kv_cache_tokens=16384)  # dtype auto: bfloat16 on CUDA
    assert llm.engine.runner.dtype is torch.bfloat16
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24, temperature=0),
    )
    assert "Paris" in out[0].outputs[0].text


def test_host_tier_on_cuda_matches_transformers(tiny_model) -> None:
    """An evicted prefix loaded back from pinned host memory (copies queued on the stream, CUDA
    graphs and async scheduling on) gives transformers' tokens; the copy time is measured."""
    folder = tiny_model("llama")
    prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=160, kv_offload_gib=0.001)
    assert llm.engine.runner.host_pool is not None and llm.engine.runner.host_pool.data.is_pinned()
    for prompt in (prefix + tail_a, filler, prefix + tail_b):
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == hf_greedy(load_hf(folder), prefix + tail_b, 24, True)
    assert llm.engine.stats().host_tier_hit_tokens == 64
    llm.generate([{"prompt_token_ids": filler}], GREEDY)  # from the host tier too, by now
    stats = llm.engine.stats()
    assert stats.host_tier_hit_tokens > 64 and stats.host_tier_copy_seconds > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_host_tier_loads_beside_a_running_batch(tiny_model) -> None:
    """A request whose prefix is in the host tier sits out the step that loads it (on a stream
    of its own, beside that step's forward); both requests give transformers' tokens."""
    folder = tiny_model("llama")
    prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=160, kv_offload_gib=0.001)
    engine = llm.engine
    assert engine.scheduler.overlap_loads
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt in (prefix + tail_a, filler):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0))
    busy = random_prompts([10], seed=2)[0]
    engine.add_request("busy", busy, short)
    assert [d.request_id for d in engine.step()] == ["busy"]
    engine.add_request("again", prefix + tail_b, short)
    assert [d.request_id for d in engine.step()] == ["busy"]  # "again" loads meanwhile
    while engine.has_unfinished_requests():
        engine.step()
    hf = load_hf(folder)
    assert engine.get_output("again").num_cached_tokens == 64
    for rid, prompt in (("busy", busy), ("again", prefix + tail_b)):
        assert engine.get_output(rid).outputs[0].token_ids == hf_greedy(hf, prompt, 8, True)
    assert engine.stats().host_tier_hit_tokens == 64
    assert engine.runner.host_pool._side is not None  # the loads ran on a stream of their own


def test_host_tier_offloads_a_reservations_blocks_at_once(tiny_model) -> None:
    """Blocks a remote prefill's reservation takes are in host memory when it is handed out."""
    folder = tiny_model("llama")
    prefix, tail_a, filler, tail_b = random_prompts([64, 10, 140, 20], seed=11)
    llm = LLM(str(folder), dtype="float32", kv_cache_tokens=160, kv_offload_gib=0.001)
    engine = llm.engine
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prefix + tail_a}], short)
    assert engine.reserve_prefill("remote", filler, short) is not None
    for block_id in engine.scheduler._reserved["remote"].block_table:
        engine.runner.kv_cache.data[:, :, block_id] = 7.0  # what the remote KV overwrote
    engine.release_prefill("remote")
    while engine.has_unfinished_requests():
        engine.step()
    out = llm.generate([{"prompt_token_ids": prefix + tail_b}], short)[0]
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == hf_greedy(load_hf(folder), prefix + tail_b, 8, True)
