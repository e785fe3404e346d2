"""The dispatch policies' decisions: where a prompt is prefilled, and which prefill worker a
decode worker falls back on when the router expects it to hold the prompt's prefix (the router's
index runs ahead of a worker's cache: blocks sent a moment ago are cached once their KV has
arrived, and blocks are evicted without telling the router)."""

from __future__ import annotations

import random

import pytest

from pdmesh.prefix_hash import hash_prefix_blocks
from pdmesh.router.policies import LocalTargets, PromptInfo, create_policy
from pdmesh.router.policies.base import NO_TARGETS, DispatchPolicy
from pdmesh.router.prefill_rate import PrefillRate
from pdmesh.router.registry import Worker

BS = 16


def _prompt(num_tokens: int) -> PromptInfo:
    rng = random.Random(num_tokens)
    ids = [rng.randrange(100, 30000) for _ in range(num_tokens)]
    return PromptInfo(num_tokens, hash_prefix_blocks(ids, BS), BS)


def _measured(
    name: str, targets: LocalTargets = NO_TARGETS, local_s_per_token: float = 0.001
) -> tuple[DispatchPolicy, Worker, Worker]:
    """A load-aware policy whose router measured 1 ms a prompt token through the prefill queue
    and `local_s_per_token` on decode workers; a decode and a prefill worker."""
    rate = PrefillRate()
    rate.observe(remote=True, seconds=0.64, tokens=640)
    rate.observe(remote=False, seconds=320 * local_s_per_token, tokens=320)
    policy = create_policy(
        name, overlap_weight=1.0, disagg_min_tokens=64, rate=rate, targets=targets
    )
    return policy, Worker("d:1", "decode"), Worker("p:1", "prefill")


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_a_long_prompt_the_decode_worker_likely_holds_names_a_fallback(name: str) -> None:
    policy = create_policy(name, overlap_weight=1.0, disagg_min_tokens=64)
    prompt = _prompt(90)  # 5 full blocks and 10 tokens
    decode, prefill = Worker("d:1", "decode"), Worker("p:1", "prefill")
    cold = policy.choose(prompt, [decode], [prefill])
    assert (cold.prefill, cold.fallback) == (prefill, None)
    decode.index.insert(prompt.block_hashes)  # sent there a moment ago
    warm = policy.choose(prompt, [decode], [prefill])
    assert warm.prefill is None and warm.prefill_miss_blocks == 0
    assert warm.fallback is prefill


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_a_short_prompt_or_no_prefill_pool_is_prefilled_locally_without_fallback(
    name: str,
) -> None:
    policy = create_policy(name, overlap_weight=1.0, disagg_min_tokens=64)
    decode, prefill = Worker("d:1", "decode"), Worker("p:1", "prefill")
    short = policy.choose(_prompt(63), [decode], [prefill])
    assert (short.prefill, short.fallback) == (None, None)
    alone = policy.choose(_prompt(300), [decode], [])
    assert (alone.prefill, alone.fallback) == (None, None)


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_load_aware_disaggregation_prefills_locally_behind_a_long_prefill_queue(name: str) -> None:
    """With the measured prefill rate (--load-aware-disagg), a prompt long enough to send is
    prefilled on its decode worker when the prefill worker's queue would make it wait longer
    than its own prefill holds up the decode worker; without a rate, or off, it is sent."""
    rate = PrefillRate()
    policy = create_policy(name, overlap_weight=1.0, disagg_min_tokens=64, rate=rate)
    off = create_policy(name, overlap_weight=1.0, disagg_min_tokens=64)
    decode, prefill = Worker("d:1", "decode"), Worker("p:1", "prefill")
    prompt = _prompt(320)  # 20 blocks
    prefill.inflight_blocks = 40  # 640 tokens queued on the prefill worker
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill  # nothing measured
    rate.observe(remote=True, seconds=0.64, tokens=640)  # 1 ms a token through the queue
    rate.observe(remote=False, seconds=0.32, tokens=320)  # 1 ms a token on the decode worker
    local = policy.choose(prompt, [decode], [prefill])
    assert (local.prefill, local.fallback) == (None, None)  # no fallback: prefilled there
    assert "prefill queue" in local.reason
    assert off.choose(prompt, [decode], [prefill]).prefill is prefill
    prefill.inflight_blocks = 10  # 160 tokens queued: less than the prompt's own 320
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill
    rate.observe(remote=False, seconds=10.0, tokens=320)  # prefill is slow on decode workers
    prefill.inflight_blocks = 40
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_load_aware_disaggregation_keeps_the_prompt_remote_while_the_queue_meets_the_ttft_target(
    name: str,
) -> None:
    """A queue longer than the local prefill, but short enough that the prompt's first token
    through the prefill worker still meets the TTFT target, costs the prompt nothing it was
    promised: the prompt is sent, and the decode worker's streams are not stalled. Past the
    target it is prefilled locally."""
    policy, decode, prefill = _measured(name, LocalTargets(ttft_s=1.0))
    prompt = _prompt(320)
    prefill.inflight_blocks = 25  # 400 queued + 320 own: ~0.72 s to the first token
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill
    prefill.inflight_blocks = 36  # 576 + 320: ~0.9 s, within the target but not its headroom
    assert policy.choose(prompt, [decode], [prefill]).prefill is None
    prefill.inflight_blocks = 50  # 800 + 320: ~1.12 s, past the target
    local = policy.choose(prompt, [decode], [prefill])
    assert local.prefill is None and "prefill queue" in local.reason


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_load_aware_disaggregation_stalls_no_stream_past_the_inter_token_target(name: str) -> None:
    """With a p99 inter-token target, a decode worker that runs streams prefills locally only
    what stalls them less than the target, however long the prefill queue; an idle one still
    takes the prompt (no stream to stall), and so does one whose stall fits the target."""
    targets = LocalTargets(ttft_s=1.0, itl_p99_s=0.025)
    policy, decode, prefill = _measured(name, targets)  # 1 ms a token here: a 0.32 s stall
    prompt = _prompt(320)
    prefill.inflight_blocks = 100  # 1,600 queued: the prompt would miss its TTFT target there
    assert policy.choose(prompt, [decode], [prefill]).prefill is None  # no streams running
    decode.load.num_running = 8
    sent = policy.choose(prompt, [decode], [prefill])
    assert sent.prefill is prefill  # 0.32 s would stall 8 streams past 25 ms
    quick, _, _ = _measured(name, targets, local_s_per_token=0.00002)  # a ~6 ms prefill
    assert quick.choose(prompt, [decode], [prefill]).prefill is None


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_the_inter_token_target_counts_streams_the_workers_stats_do_not_show_yet(name: str) -> None:
    """Stats come every half second: a decode worker they show idle may already run streams this
    router sent it since (a burst of arrivals). Those streams count too."""
    policy, decode, prefill = _measured(name, LocalTargets(ttft_s=1.0, itl_p99_s=0.025))
    prompt = _prompt(320)
    prefill.inflight_blocks = 100
    assert decode.load.num_running == 0
    decode.streams = 2  # sent since its last stats
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill
    decode.streams = 0
    assert policy.choose(prompt, [decode], [prefill]).prefill is None


@pytest.mark.parametrize("name", ["kv", "round_robin"])
def test_load_aware_disaggregation_counts_the_prompts_the_decode_worker_already_prefills(
    name: str,
) -> None:
    """Prompts a decode worker prefills for this router come before a new one there: once they
    would take longer than the prefill worker's queue, the prompt is sent (on two H200s, 8B
    prefill-heavy load at 16 a second put 51 of 64 prompts on the decode worker and their first
    tokens 1.5 s late when they did not count)."""
    policy, decode, prefill = _measured(name)  # 1 ms a token, both ways
    prompt = _prompt(320)
    prefill.inflight_blocks = 60  # 960 queued: 0.96 s
    assert policy.choose(prompt, [decode], [prefill]).prefill is None  # 0.32 s here
    decode.local_prefill_blocks = 45  # 720 tokens ahead of it there: 1.04 s in all
    assert policy.choose(prompt, [decode], [prefill]).prefill is prefill
    decode.local_prefill_blocks = 20  # 320 ahead: 0.64 s in all
    assert policy.choose(prompt, [decode], [prefill]).prefill is None


def test_a_prompts_local_tokens_are_the_decode_workers_prefill_queue_and_its_uncached_part() -> (
    None
):
    """What a decode worker computes before a prompt's first token there, which the router both
    predicts with and times local prefills by: its queue of prompts from this router, then the
    prompt's blocks it does not hold."""
    decode = Worker("d:1", "decode")
    prompt = _prompt(90)  # 5 full blocks and 10 tokens
    assert prompt.local_tokens(decode) == 90
    decode.index.insert(prompt.block_hashes[:3])
    assert prompt.local_tokens(decode) == 90 - 3 * BS
    decode.local_prefill_blocks = 7
    assert prompt.local_tokens(decode) == 7 * BS + 90 - 3 * BS
