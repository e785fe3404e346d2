"""Speculative decoding: exact greedy output, the paged cache rolled back, options kept."""

from __future__ import annotations

import json

import pytest
import torch
from support import hf_greedy, load_hf, make_tiny_model, random_prompts

from pdmesh import LLM, SamplingParams
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.spec_decode.config import SpeculativeConfig
from pdmesh.flags import engine_argv
from pdmesh.prefix_hash import ROOT_HASH, hash_chain

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# Speculation on at any batch size: these tests check exactness, not speed.
ALWAYS = {**NGRAM, "disable_by_batch_size": None}


def _looping_prompts() -> list[list[int]]:
    """Prompts that repeat themselves (the n-gram lookup finds matches) among random ones."""
    a, b, c, d = random_prompts([7, 5, 40, 23], seed=11)
    return [a * 4, b * 6 + a, c, d + d[:9], a + b + a + b + a]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_config_is_checked_with_the_field_named() -> None:
    bad = [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"num_speculative_tokens": 4, "lookahead": 2}, "lookahead"),
        ({"method": "ngram", "model": "x"}, "model"),
        ({"method": "draft_model"}, "model"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ]
    for value, name in bad:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="pipeline"):
        EngineConfig(speculative_config=NGRAM, pipeline_parallel_size=2)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == (
        "draft_model"
    )
    # A dict is kept as JSON: the form the CLI flag and `pdmesh up`'s pass-through carry.
    config = EngineConfig(speculative_config=NGRAM)
    assert config.speculative == SpeculativeConfig(**NGRAM)
    argv = engine_argv({"speculative_config": config.speculative_config})
    assert json.loads(argv[argv.index("--speculative-config") + 1])["prompt_lookup_max"] == 3


def test_greedy_equals_speculation_off_and_transformers(tiny_model) -> None:
    """Continuous batching of prompts of several lengths, small blocks (rejected drafts cross
    block boundaries), prefix caching on: token-identical, drafts accepted and rejected, and
    every block back in the free pool at the end."""
    folder = str(tiny_model("llama"))
    prompts = _looping_prompts()
    off = _greedy(LLM(folder, kv_cache_tokens=2048, block_size=4), prompts)
    spec = LLM(folder, kv_cache_tokens=2048, block_size=4, speculative_config=ALWAYS)
    on = _greedy(spec, prompts)
    assert on == off
    hf = load_hf(tiny_model("llama"))
    assert on[0] == hf_greedy(hf, prompts[0], 24, ignore_eos=True)
    assert on[3] == hf_greedy(hf, prompts[3], 24, ignore_eos=True)
    stats = spec.engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed  # both paths taken
    free = spec.engine.stats()
    assert free.kv_blocks_free == free.kv_blocks_total
    # The prefix cache holds only accepted tokens' KV: a rerun hits it and outputs the same.
    again = spec.generate(
        [{"prompt_token_ids": prompts[0] + on[0]}],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert again.num_cached_tokens >= 4 * ((len(prompts[0]) + 20) // 4)
    assert (
        again.outputs[0].token_ids
        == _greedy(LLM(folder, kv_cache_tokens=2048, block_size=4), [prompts[0] + on[0]], 8)[0]
    )


def test_rejected_slots_are_rolled_back(tiny_model) -> None:
    """After every step: each running sequence holds exactly the blocks its computed tokens
    need (those taken for rejected drafts are free again), and each block it published to the
    prefix cache holds its own tokens."""
    folder = str(tiny_model("llama"))
    llm = LLM(folder, kv_cache_tokens=1024, block_size=4, speculative_config=ALWAYS)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate(_looping_prompts()):
        engine.add_request(str(i), p, params)
    blocks = engine.scheduler._blocks
    verified = 0
    while engine.has_unfinished_requests():
        engine.step()
        verified = engine.speculator.stats.verify_steps
        held = 0
        for seq in engine.scheduler.running:
            assert not seq.spec_token_ids
            assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)
            held += len(seq.block_table)
            # The published chain covers computed (accepted) tokens only, and a block that
            # carries a hash holds its tokens (a block whose content another block published
            # first carries none).
            bs, hashes = 4, seq.block_hashes
            assert hashes == hash_chain(ROOT_HASH, seq.token_ids[: len(hashes) * bs], bs)
            assert len(hashes) <= seq.num_computed_tokens // bs
            for j, h in enumerate(hashes):
                block = blocks.blocks[seq.block_table[j]]
                if block.hash is not None:
                    assert block.hash == h
                    assert block.token_ids == tuple(seq.token_ids[bs * j : bs * j + bs])
        assert blocks.num_used_blocks == held
    assert verified > 0 and engine.speculator.stats.accepted > 0
    assert blocks.num_free_blocks == blocks.num_blocks


def test_options_keep_their_meaning(tiny_model) -> None:
    """Seeded sampling, logprobs, n, stop ids, max_tokens, min_tokens and penalties (the last
    two decode without drafts) give what they give with speculation off."""
    folder = str(tiny_model("llama"))
    prompts = _looping_prompts()[:3]
    off = LLM(folder, kv_cache_tokens=2048)
    on = LLM(folder, kv_cache_tokens=2048, speculative_config=ALWAYS)
    first = _greedy(off, prompts[:1], 24)[0]
    cases = [
        SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0, n=2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[first[9]], ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True),
    ]
    for params in cases:
        reqs = [{"prompt_token_ids": p} for p in prompts]
        want = off.generate(reqs, params, use_tqdm=False)
        got = on.generate(reqs, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            for wc, gc in zip(w.outputs, g.outputs, strict=True):
                assert gc.token_ids == wc.token_ids, params
                assert gc.finish_reason == wc.finish_reason
                if params.logprobs:
                    assert len(gc.logprobs) == len(wc.logprobs)
                    for a, b in zip(gc.logprobs, wc.logprobs, strict=True):
                        assert a.keys() == b.keys()
                        for t in a:
                            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)
    assert on.engine.speculator.stats.accepted > 0
    stats = on.engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def _small_vocab_model(folder, vocab: int = 12) -> str:
    """A random 2-layer Llama over `vocab` tokens whose next-token distributions are peaked
    enough that n-gram drafts are often accepted and often rejected."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdmesh.bench.gpu_models import save_word_tokenizer

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.25)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, vocab)
    return str(folder)


def _exact_marginals(
    folder: str, prompt: list[int], vocab: int, temperature: float = 1.0
) -> torch.Tensor:
    """[3, V]: the target's exact law of each of the first three sampled tokens at
    `temperature`, summed over every path, from transformers."""
    hf = load_hf(folder)
    with torch.no_grad():

        def dist(prefixes: list[list[int]]) -> torch.Tensor:
            logits = hf(torch.tensor(prefixes)).logits[:, -1].float()  # type: ignore[operator]
            return torch.softmax(logits / temperature, -1)  # [N, V]

        p1 = dist([prompt])[0]
        p2 = dist([[*prompt, a] for a in range(vocab)])  # [V, V]: given t1 = a
        pairs = [[*prompt, a, b] for a in range(vocab) for b in range(vocab)]
        p3 = dist(pairs).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    return torch.stack([p1, joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))])


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's goodness-of-fit test (cells with expectation < 5 pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    # The chi-square survival function: the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def test_sampling_keeps_the_target_distribution(tmp_path) -> None:
    """4000 unseeded samples of three tokens (temperature 1) with n-gram speculation: each
    token's histogram fits the target's exact law (chi-square), while drafts were accepted and
    rejected. The test can fail: the same samples do not fit the law at temperature 1.5."""
    vocab, n = 12, 4000
    folder = _small_vocab_model(tmp_path, vocab)
    # The model's own greedy loop: drafts the lookup finds there are often likely tokens.
    start = [1, 5, 9, 2, 7]
    prompt = start + _greedy(LLM(folder, kv_cache_tokens=1024), [start], 14)[0]
    llm = LLM(folder, kv_cache_tokens=8192, max_num_seqs=512, speculative_config=ALWAYS)
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])  # [n, 3]
    stats = llm.engine.speculator.stats
    assert stats.accepted > 400 and stats.proposed - stats.accepted > 400
    exact = _exact_marginals(folder, prompt, vocab)
    for position in range(3):
        counts = torch.bincount(tokens[:, position], minlength=vocab)
        assert _chi_square_p(counts, exact[position]) > 1e-3, position
    hot = _exact_marginals(folder, prompt, vocab, temperature=1.5)
    assert _chi_square_p(torch.bincount(tokens[:, 2], minlength=vocab), hot[2]) < 1e-6


def test_draft_model_greedy_is_exact(tiny_model, tmp_path) -> None:
    """A draft model of the target's vocabulary: the target itself (every draft accepted) and
    another random model (most rejected) give speculation-off's tokens; a draft of another
    vocabulary is refused by name."""
    folder = str(tiny_model("llama"))
    prompts = _looping_prompts()
    off = _greedy(LLM(folder, kv_cache_tokens=2048, block_size=4), prompts)
    other = str(make_tiny_model(tmp_path / "other", "llama", seed=1))
    for draft in (folder, other):
        spec = {"model": draft, "num_speculative_tokens": 3, "disable_by_batch_size": None}
        llm = LLM(folder, kv_cache_tokens=2048, block_size=4, speculative_config=spec)
        assert _greedy(llm, prompts) == off
        stats = llm.engine.speculator.stats
        if draft == folder:
            assert stats.accepted == stats.proposed > 0
        else:
            assert stats.accepted < stats.proposed
        free = llm.engine.stats()
        assert free.kv_blocks_free == free.kv_blocks_total
    small = _small_vocab_model(tmp_path / "small", 12)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(folder, kv_cache_tokens=1024, speculative_config={"model": small})


def test_tensor_parallel_worker_speculates_exactly(tiny_model) -> None:
    """TP=2 (gloo): the followers run the verify step's extra rows (vocab-parallel LM head)."""
    folder = str(tiny_model("qwen3"))
    prompts = _looping_prompts()[:3]
    off = _greedy(LLM(folder, kv_cache_tokens=1024), prompts)
    with LLM(
        folder, kv_cache_tokens=1024, tensor_parallel_size=2, speculative_config=ALWAYS
    ) as llm:
        assert _greedy(llm, prompts) == off
        assert llm.engine.speculator.stats.accepted > 0
