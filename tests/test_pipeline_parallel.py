"""Pipeline parallelism on CPU (gloo): real follower processes, real point-to-point sends."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from support import hf_greedy, load_hf, random_prompts, running

from pdmesh import LLM, SamplingParams
from pdmesh.engine.parallel.pipeline import layer_partition

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def test_layer_partition_even_uneven_and_given() -> None:
    assert layer_partition(30, 2) == [range(0, 15), range(15, 30)]
    # Extra layers go to the stages before the last, which also runs the LM head.
    assert layer_partition(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert layer_partition(3, 2, "1,2") == [range(0, 1), range(1, 3)]


@pytest.mark.parametrize(
    ("layers", "pp", "spec", "message"),
    [
        (3, 4, None, "pipeline_parallel_size 4 is more than the model's 3 layers"),
        (3, 2, "2,2", "must be 2 positive layer counts that add up to the model's 3 layers"),
        (3, 2, "3,0", "must be 2 positive layer counts"),
        (3, 2, "a,b", "PDMESH_PP_LAYER_PARTITION='a,b'"),
    ],
)
def test_a_layout_that_cannot_fit_is_refused(layers, pp, spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        layer_partition(layers, pp, spec)


def test_pipeline_refuses_before_any_rank_starts(tiny_model) -> None:
    folder = str(tiny_model("qwen3_moe"))  # 3 layers
    before = running("pdmesh.engine.executor.follower", os.getpid())
    with pytest.raises(ValueError, match="more than the model's 3 layers"):
        LLM(folder, pipeline_parallel_size=4)
    assert running("pdmesh.engine.executor.follower", os.getpid()) == before  # no rank started


def test_tied_head_pp2_equals_pp1(small_llm: LLM, small_model_folder: Path) -> None:
    """The default model's layout, small (conftest): it ties its LM head to the embedding, so
    the last stage loads the embedding's tensor as its head."""
    prompts = ["Hello, my name is", "def fibonacci(n):", "The capital of France is"]
    expected = [o.outputs[0].token_ids for o in small_llm.generate(prompts, GREEDY)]
    llm = LLM(str(small_model_folder), kv_cache_tokens=4096, pipeline_parallel_size=2)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    runner = llm.engine.runner
    assert runner.kv_spec.num_layers == 2  # rank 0's cache: its own 2 of 4 layers
    assert runner.model.lm_head is None and runner.model.model.norm is None
    start = time.perf_counter()
    llm.close()
    assert time.perf_counter() - start < 5.0  # generous for a loaded 2-core machine
    assert got == expected


@pytest.mark.parametrize(
    ("arch", "tp", "pp", "partition"),
    [
        ("qwen3_moe", 1, 3, None),
        ("qwen3_moe", 1, 2, "1,2"),
        ("llama", 2, 2, None),
        ("qwen3", 1, 2, None),
        ("mixtral", 1, 2, None),
    ],
    ids=["qwen3-moe-pp3", "qwen3-moe-pp2-uneven", "llama-tp2xpp2", "qwen3-pp2", "mixtral-pp2"],
)
def test_pipeline_matches_transformers(tiny_model, monkeypatch, arch, tp, pp, partition) -> None:
    """Chunked prefill (64-token budget), prefix caching (prompts share a prefix) and a cache
    small enough to preempt, against transformers token for token."""
    if partition:
        monkeypatch.setenv("PDMESH_PP_LAYER_PARTITION", partition)
    folder = tiny_model(arch)
    shared = random_prompts([40], seed=7)[0]
    prompts = [shared + p for p in random_prompts([5, 30, 90], seed=3)] + random_prompts([150])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    layout = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
    with LLM(str(folder), kv_cache_tokens=256, max_num_batched_tokens=64, **layout) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.stats()
    hf = load_hf(folder)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 16, ignore_eos=True)
    assert stats.prefix_hit_tokens > 0
    assert stats.num_preemptions > 0


def test_seeded_sampling_over_a_pipeline_with_a_batch_per_stage(tiny_model, monkeypatch) -> None:
    """Seeded sampling gives the same tokens over three stages with three batches in flight
    (one per stage, each of other sequences). The steps reach the stages through shared memory,
    sent from rank 0's outbox thread (engine/parallel/step_channel.py; GPUs' default)."""
    monkeypatch.setenv("PDMESH_STEP_CHANNEL", "shm")
    folder = str(tiny_model("qwen3_moe"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([8, 20, 33])]
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=s) for s in (1, 2, 3)]
    with LLM(folder, kv_cache_tokens=1024) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    pipeline = dict(pipeline_parallel_size=3, async_scheduling=True)
    with LLM(folder, kv_cache_tokens=1024, **pipeline) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.most_in_flight == 3
        assert llm.engine.tp_driver.channel.shared
    assert got == expected


def test_a_step_is_launched_ahead_over_stages_of_one_rank(tiny_model) -> None:
    """One sequence cannot fill a batch per stage: with async scheduling its next step is
    launched before the host reads its token, whose id stays on rank 0's device (stage 0
    embeds it; no other stage reads ids). Greedy and seeded tokens equal one stage's."""
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 40])]
    params = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=5, ignore_eos=True),
    ]

    def one_at_a_time(llm: LLM) -> list[list[int]]:
        pairs = zip(prompts, params, strict=True)
        return [llm.generate([p], q)[0].outputs[0].token_ids for p, q in pairs]

    with LLM(folder, kv_cache_tokens=1024) as llm:
        expected = one_at_a_time(llm)
    with LLM(folder, kv_cache_tokens=1024, pipeline_parallel_size=2, async_scheduling=True) as llm:
        got = one_at_a_time(llm)
        assert llm.engine.steps_launched_ahead > 0
    assert got == expected


def test_each_batch_in_flight_launches_its_next_step_ahead(tiny_model) -> None:
    """Four sequences over two stages: a batch per stage, and each batch's next step is launched
    before the host reads its tokens, beside the other batch in flight (neither the stages nor
    the host then wait for each other). Greedy and seeded tokens equal one stage's, and
    sequences of different lengths end on time."""
    folder = str(tiny_model("llama"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 40, 17, 25])]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (16, 12, 20, 7)]
    params[1] = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    with LLM(folder, kv_cache_tokens=1024) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(folder, kv_cache_tokens=1024, pipeline_parallel_size=2, async_scheduling=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        engine = llm.engine
        assert engine.most_in_flight == 2
        # Each batch of two decodes about a dozen tokens: most of them are launched ahead.
        assert engine.steps_launched_ahead >= 15, engine.steps_launched_ahead
        assert engine.stats().kv_blocks_used == 0  # every block freed
    assert got == expected
    assert [len(t) for t in got] == [16, 12, 20, 7]


def test_greedy_steps_are_sampled_on_the_last_stage(tiny_model) -> None:
    """A step whose rows are all plain greedy is sampled where its logits are: the last stage
    sends rank 0 token ids instead of [S, V] logits. Tokens equal one stage's; a row asking for
    log-probabilities takes its batch's logits back to rank 0, and they equal one stage's."""
    folder = str(tiny_model("qwen3"))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 30, 17])]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    with LLM(folder, kv_cache_tokens=1024) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        want_scored = llm.generate(prompts, [greedy, scored, greedy])[1].outputs[0]
    with LLM(folder, kv_cache_tokens=1024, pipeline_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        sampled_last = llm.engine.runner.steps_sampled_last
        got_scored = llm.generate(prompts, [greedy, scored, greedy])[1].outputs[0]
    assert got == want
    assert sampled_last >= 10  # every decode step of both batches
    assert got_scored.token_ids == want_scored.token_ids
    assert got_scored.logprobs is not None and want_scored.logprobs is not None
    for mine, theirs in zip(got_scored.logprobs, want_scored.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        for token, entry in mine.items():
            assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)
