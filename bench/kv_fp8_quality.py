"""An fp8 KV cache (`kv_cache_dtype="fp8"`) against one of the model's dtype, on the default
model's real weights: perplexity of a text, next-token agreement along it, and greedy agreement
over 32 prompts.

    python -m pdmesh.bench.kv_fp8_quality [--text README.md] [--max-tokens 8192] [--json-out F]
                                          [--no-calibrated]

Perplexity: the first --max-tokens tokens of the text cut into windows of 1,024, each scored by
its own prompt log-probabilities (bench/fp8_quality.py's method). Next-token agreement: at each
scored position, whether both caches rank the same token first (teacher-forced: both see the
text, so one early difference does not carry over). Greedy: the 32 prompts of
bench/fp8_quality.py, 32 new tokens each; a free-running continuation differs from its first
differing token on, so the share of identical continuations is the harshest of the three.
Both engines run here, one after the other, on the same weights and kernels. A third run (off
with --no-calibrated) sets per-layer scales from the data instead of the default 1.0: each
layer's largest |K| and |V| over the text's first window, computed in the model's dtype, mapped
to half of e4m3's 448 (docs/kv-cache.md says why the engine keeps 1.0).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.fp8_quality import greedy, prose_prompts
from pdmesh.bench.report import first_difference, run_info, write_json_out

WINDOW = 1024
HEADROOM = 2.0  # calibrated scales: the largest value seen lands at 448 / HEADROOM


def score(llm: Any, ids: list[int]) -> tuple[dict[str, float], list[int]]:
    """Perplexity figures of `ids` and the top-ranked token at every scored position."""
    from pdmesh import SamplingParams

    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, top = 0.0, []
    for window, out in zip(windows, outputs, strict=True):
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            top.append(next(t for t, lp in position.items() if lp.rank == 1))
    figures = {
        "tokens_scored": len(top),
        "perplexity": math.exp(nll / len(top)),
        "seconds": time.perf_counter() - start,
    }
    return figures, top


def amax_per_layer(text: str) -> list[tuple[float, float]]:
    """Each layer's largest |K| and |V| over the text's first window, from a cache of the model's
    dtype."""
    from pdmesh import LLM, SamplingParams

    with LLM(kv_cache_tokens=4096) as llm:
        ids = llm.get_tokenizer().encode(text)[:WINDOW]
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
        cache = llm.engine.runner.kv_cache.data  # [L, 2, blocks, block_size, kv_heads, head_dim]
        return [(float(c[0].abs().max()), float(c[1].abs().max())) for c in cache]


def measure(
    text: str, max_tokens: int, kv_cache_dtype: str, amax: list[tuple[float, float]] | None = None
) -> dict[str, Any]:
    from pdmesh import LLM

    with LLM(
        kv_cache_tokens=16384, max_num_batched_tokens=2048, kv_cache_dtype=kv_cache_dtype
    ) as llm:
        if amax is not None:
            for layer, (k, v) in zip(llm.engine.runner.model.attention_layers(), amax, strict=True):
                layer.k_scale, layer.v_scale = k * HEADROOM / 448, v * HEADROOM / 448
        tok = llm.get_tokenizer()
        ppl, top = score(llm, tok.encode(text)[:max_tokens])
        tokens = greedy(llm, [tok.encode(p) for p in prose_prompts(text)])
        nbytes = llm.engine.runner.kv_spec.bytes_per_block
    return {"perplexity": ppl, "top": top, "greedy": tokens, "block_bytes": nbytes}


def compare(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`other`'s figures against `base`'s."""
    firsts = [first_difference(a, b) for a, b in zip(base["greedy"], other["greedy"], strict=True)]
    same = sum(
        sum(x == y for x, y in zip(a, b, strict=False))
        for a, b in zip(base["greedy"], other["greedy"], strict=True)
    )
    agree = sum(a == b for a, b in zip(base["top"], other["top"], strict=True))
    ppl = other["perplexity"]
    return {
        "perplexity": ppl,
        "perplexity_change": ppl["perplexity"] / base["perplexity"]["perplexity"] - 1,
        "next_token_agreement": agree / len(base["top"]),
        "block_bytes": other["block_bytes"],
        "prompts": len(firsts),
        "greedy_identical": sum(f is None for f in firsts),
        "greedy_first_difference": firsts,
        "greedy_positions_equal": same / sum(len(a) for a in base["greedy"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--text", type=Path, default=Path("README.md"))
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--no-calibrated", dest="calibrated", action="store_false")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    text = args.text.read_text()
    base = measure(text, args.max_tokens, "auto")
    runs = {"fp8": compare(base, measure(text, args.max_tokens, "fp8"))}
    if args.calibrated:
        amax = amax_per_layer(text)
        runs["fp8_calibrated"] = compare(base, measure(text, args.max_tokens, "fp8", amax))
        runs["fp8_calibrated"]["amax"] = amax
    figures = {
        **run_info(),
        "text": str(args.text),
        "model_dtype_cache": {"perplexity": base["perplexity"], "block_bytes": base["block_bytes"]},
        **runs,
    }
    write_json_out(args.json_out, figures)
    b_ppl = base["perplexity"]
    print(
        f"{b_ppl['tokens_scored']} tokens of {args.text} scored; model-dtype cache: perplexity "
        f"{b_ppl['perplexity']:.4f}, {base['block_bytes']} bytes a block"
    )
    for name, r in runs.items():
        print(
            f"{name}: perplexity {r['perplexity']['perplexity']:.4f} "
            f"({r['perplexity_change']:+.2%}), next-token agreement "
            f"{r['next_token_agreement']:.2%}, greedy (32 tokens) {r['greedy_identical']}/"
            f"{r['prompts']} prompts identical, {r['greedy_positions_equal']:.1%} of positions "
            f"equal, {r['block_bytes']} bytes a block"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
