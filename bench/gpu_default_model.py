"""The default model on a GPU against the CPU engine, and bf16 against transformers.

    python -m pdmesh.bench.gpu_default_model --make-reference REF.json        # on the CPU
    python -m pdmesh.bench.gpu_default_model --gguf SmolLM2.gguf --reference REF.json --out DIR

The reference holds the CPU engine's greedy tokens (float32) for fixed prompts, as token ids so
the GPU run needs no tokenizer agreement. On the GPU: the same prompts in float32 must give the
same tokens; a tiny random Llama in bf16 is compared with transformers in bf16, reporting where
bf16 rounding flips an argmax (if it does).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.gpu_models import decoder_config, random_checkpoint
from pdmesh.bench.gpu_workloads import greedy_tokens
from pdmesh.bench.report import compare_tokens, out_parser

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox",
    "def fibonacci(n):",
    "In 1492,",
    "Once upon a time there was a dragon who lived in a cave near the village, and every night",
    "1 2 3 4 5",
    "The meaning of life is",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of",
]
NEW_TOKENS = 32


def _greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens, stopping at EOS as the reference did."""
    from pdmesh import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def make_reference(path: Path) -> None:
    from pdmesh import LLM

    llm = LLM(kv_cache_tokens=16384)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = {"prompts": prompts, "tokens": _greedy(llm, prompts), "device": "cpu", "dtype": "float32"}
    path.write_text(json.dumps(ref))


def on_gpu(gguf: Path, reference: Path, out: Path) -> dict[str, Any]:
    from pdmesh import LLM

    ref = json.loads(reference.read_text())
    llm = LLM(str(gguf) if gguf else None, dtype="float32", kv_cache_tokens=16384)
    got = _greedy(llm, ref["prompts"])
    result: dict[str, Any] = {
        "default_model_fp32_gpu_equals_cpu": got == ref["tokens"],
        "first_difference": compare_tokens(got, ref["tokens"])["first_difference"],
    }
    del llm
    result["tiny_llama_bf16_vs_transformers_bf16"] = tiny_bf16()
    (out / "default_model.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return result


def tiny_bf16() -> dict[str, Any]:
    """bf16 on both sides; equal tokens, or where rounding first flips an argmax."""
    import random

    from transformers import LlamaForCausalLM

    from pdmesh import LLM

    config = decoder_config("LlamaConfig", (512, 256, 512, 4, 8, 4), max_position_embeddings=1024)
    folder = random_checkpoint(config, Path(tempfile.mkdtemp()), 0.08)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 17, 40, 100, 150, 3)]
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_tokens=4096, skip_tokenizer_init=True)
    ours = greedy_tokens(llm, prompts, 24)
    refs = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
        )
        refs.append(ref[0, len(p) :].tolist())
    return compare_tokens(ours, refs)


def main() -> None:
    parser = out_parser(__doc__, out_required=False)
    parser.add_argument("--make-reference", type=Path)
    parser.add_argument("--gguf", type=Path, help="the model file (default: the embedded model)")
    parser.add_argument("--reference", type=Path)
    args = parser.parse_args()
    if args.make_reference:
        make_reference(args.make_reference)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    on_gpu(args.gguf, args.reference, args.out)


if __name__ == "__main__":
    main()
