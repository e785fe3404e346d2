"""FP8 against the unquantized model on the default model's real weights: perplexity on a fixed
text and greedy agreement over 32 prompts.

    python -m pdmesh.bench.fp8_quality [--text README.md] [--json-out FILE]

Perplexity: the text (the project's README by default) tokenized once, cut into windows of 1,024
tokens, each window scored by its own prompt log-probabilities (the first token of a window is
not scored). Greedy: 32 prompts, the first 12 words of the first 32 prose lines of the text, 32
new tokens each (stopping at EOS). Both engines run here, one after the other, on the same
weights; on the CPU the FP8 one runs the reference kernels (the W8A8 arithmetic emulated in
fp32). Prints a table; --json-out writes the figures.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.report import first_difference, run_info, write_json_out

WINDOW = 1024
NUM_PROMPTS = 32
NEW_TOKENS = 32


def prose_prompts(text: str) -> list[str]:
    """The first 12 words of each of the first 32 prose lines (not headings, code, tables or
    lists) of at least 8 words."""
    prompts = []
    for line in text.splitlines():
        words = line.split()
        if len(words) < 8 or line.startswith(("#", "|", "`", " ", "-", "*", ">", "<")):
            continue
        prompts.append(" ".join(words[:12]))
        if len(prompts) == NUM_PROMPTS:
            break
    return prompts


def perplexity(llm: Any, ids: list[int]) -> dict[str, float]:
    from pdmesh import SamplingParams

    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    windows = [w for w in windows if len(w) > 1]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    nll, scored = 0.0, 0
    for window, out in zip(windows, outputs, strict=True):
        for token, position in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            nll -= position[token].logprob
            scored += 1
    return {
        "tokens_scored": scored,
        "perplexity": math.exp(nll / scored),
        "seconds": time.perf_counter() - start,
    }


def greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from pdmesh import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def measure(text: str, **options: Any) -> tuple[dict[str, float], list[list[int]]]:
    from pdmesh import LLM

    llm = LLM(kv_cache_tokens=16384, max_num_batched_tokens=2048, **options)
    tok = llm.get_tokenizer()
    ppl = perplexity(llm, tok.encode(text))
    tokens = greedy(llm, [tok.encode(p) for p in prose_prompts(text)])
    return ppl, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--text", type=Path, default=Path("README.md"))
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    text = args.text.read_text()
    base_ppl, base = measure(text)
    fp8_ppl, fp8 = measure(text, quantization="fp8")
    firsts = [first_difference(a, b) for a, b in zip(base, fp8, strict=True)]
    same_tokens = sum(
        sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(base, fp8, strict=True)
    )
    figures = {
        **run_info(),
        "text": str(args.text),
        "unquantized": base_ppl,
        "fp8": fp8_ppl,
        "perplexity_change": fp8_ppl["perplexity"] / base_ppl["perplexity"] - 1,
        "prompts": len(base),
        "greedy_identical": sum(f is None for f in firsts),
        "greedy_first_difference": firsts,
        "greedy_positions_equal": same_tokens / sum(len(a) for a in base),
    }
    write_json_out(args.json_out, figures)
    print(
        f"perplexity over {base_ppl['tokens_scored']} tokens of {args.text}: unquantized "
        f"{base_ppl['perplexity']:.4f}, fp8 {fp8_ppl['perplexity']:.4f} "
        f"({figures['perplexity_change']:+.2%}); greedy ({NEW_TOKENS} tokens): "
        f"{figures['greedy_identical']}/{len(base)} prompts identical, "
        f"{figures['greedy_positions_equal']:.1%} of positions equal"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
