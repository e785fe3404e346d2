"""Helpers shared by tests: tiny random models and Hugging Face greedy references."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 512


def _tiny_configs() -> dict[str, tuple[type, object]]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from pdmesh.bench.gpu_models import TINY, llama3_rope

    common = dict(
        **TINY,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    rope = llama3_rope(theta=10000.0, original_max_positions=64)
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**common, rope_parameters=rope)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32)),
        "mixtral": (
            MixtralForCausalLM,
            MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        ),
        "qwen3_moe": (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **{**common, "intermediate_size": 96, "num_hidden_layers": 3},
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                head_dim=16,
                norm_topk_prob=True,
                mlp_only_layers=[1],
            ),
        ),
    }


TINY_ARCHS = tuple(_tiny_configs())


def save_word_tokenizer(folder: Path, vocab_size: int = TINY_VOCAB) -> None:
    from pdmesh.bench.gpu_models import save_word_tokenizer as save

    save(folder, vocab_size)


def _randomized(model: Any) -> Any:
    """`model` with larger weights than the default init: the argmax then depends on every
    layer."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    return model


def make_tiny_model(folder: Path, arch: str, seed: int = 0, **save_kwargs: object) -> Path:
    """Save a random-initialised model of architecture `arch` (and a tokenizer) in `folder`."""
    cls, config = _tiny_configs()[arch]
    torch.manual_seed(seed)
    model = _randomized(cls(config).eval())
    model.save_pretrained(folder, **save_kwargs)
    save_word_tokenizer(folder)
    return folder


# The default model's shape, cut down: its tokenizer, vocabulary, chat template, special tokens
# and grouped-query layout (3 KV heads, so TP=2 replicates them and TP=3 splits them), with 4
# layers of width 96 instead of 30 of 576. Mesh tests that compare the mesh with the offline
# engine run on it: a step costs a few milliseconds instead of a second on 2 cores.
SMALL_DEFAULT_SHAPE = dict(
    hidden_size=96,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=16,
    intermediate_size=192,
    num_hidden_layers=4,
)


def make_small_default_model(folder: Path, default_folder: Path, seed: int = 0) -> Path:
    """A random model of SMALL_DEFAULT_SHAPE with the default model's tokenizer files."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((default_folder / "config.json").read_text())
    config.pop("_model_name_or_path", None)
    torch.manual_seed(seed)
    model = _randomized(LlamaForCausalLM(LlamaConfig(**{**config, **SMALL_DEFAULT_SHAPE})).eval())
    model.save_pretrained(folder)
    # The default model's own generation config replaces the one save_pretrained wrote.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):  # fmt: skip
        if (default_folder / name).exists():
            shutil.copy(default_folder / name, folder / name)
    return folder


def random_prompts(lengths: list[int], seed: int = 1, vocab: int = TINY_VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def hf_greedy(
    model: object, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool
) -> list[int]:
    """Transformers' greedy `generate` on one unpadded prompt: the reference."""
    ids = torch.tensor([prompt_ids])
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    out = model.generate(  # type: ignore[attr-defined]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        **extra,
    )
    return out[0, len(prompt_ids) :].tolist()


def hf_greedy_along(
    model: object, prompt_ids: list[int], tokens: list[int], max_new_tokens: int, ignore_eos: bool
) -> list[int]:
    """Transformers' greedy choice after the prompt and each prefix of `tokens`, in one forward:
    `hf_greedy(...)` exactly when `tokens` is what it generates, without a forward per token.
    Where they part, it ends with transformers' first different choice; where `tokens` stops
    early, with the choice transformers makes next. EOS (the generation config's) ends it unless
    `ignore_eos`, which masks EOS as `min_new_tokens` does."""
    ids = torch.tensor([prompt_ids + tokens[:max_new_tokens]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]  # type: ignore[operator]
    eos = model.generation_config.eos_token_id  # type: ignore[attr-defined]
    eos = {e for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
    if ignore_eos:
        logits[:, list(eos)] = float("-inf")
    # logits[len(prompt) - 1 + i] predicts the token after tokens[:i]
    choices = logits[len(prompt_ids) - 1 :].argmax(-1).tolist()
    along = []
    for i, choice in enumerate(choices[:max_new_tokens]):
        along.append(choice)
        if i >= len(tokens) or choice != tokens[i] or (not ignore_eos and choice in eos):
            break
    return along


def load_hf(folder: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def generated_ids(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    """The first completion's token ids of each token-id prompt, through `LLM.generate`."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def close_seconds(llm: Any) -> float:
    """How long `llm.close()` takes (its other ranks and replicas stopped)."""
    start = time.perf_counter()
    llm.close()
    return time.perf_counter() - start


def descendants(pid: int) -> set[int]:
    """The processes below `pid`: its children, theirs, and so on. A rank or a worker started as
    a fork of a warm interpreter is the zygote's child, not its starter's
    (pdmesh/warm_start.py)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for listing in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                children = {int(c) for c in listing.read_text().split()}
            except OSError:  # the process or thread just ended
                continue
            todo += children - found
            found |= children
    return found


def running(module: str, under: int) -> list[int]:
    """The processes below `under` whose command line is `python -m MODULE ...`."""
    found = []
    for pid in sorted(descendants(under)):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if f" -m {module} ".encode() in command.rstrip() + b" ":
            found.append(pid)
    return found
