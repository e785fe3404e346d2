"""The kinds of streams the hand-off tests move between workers (live migration, role
switches) and check against offline runs: greedy, seeded, shaped by penalties with logprobs,
several choices, grammar-constrained; on a tiny model with an EOS token."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from pdmesh import SamplingParams
from pdmesh.sampling_params import StructuredOutputsParams
from pdmesh.v1 import generation_pb2 as gen_pb

MAX_TOKENS = 400
GREEDY = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
# State that shapes sampling: penalties over the output so far, and logprobs; a grammar whose
# next token depends on where its matcher is.
SHAPED = dict(
    max_tokens=MAX_TOKENS,
    temperature=0,
    min_tokens=MAX_TOKENS,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logprobs=2,
)
# Several choices do not move with their KV: each is recomputed elsewhere, as after a lost worker.
CHOICES = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=2)
GRAMMAR = dict(max_tokens=MAX_TOKENS, temperature=0, min_tokens=MAX_TOKENS)
REGEX = "(t1t2t3)+"


def eos_model(tiny_model: Callable[[str], Path], tmp: pytest.TempPathFactory) -> str:
    """The tiny Llama with an EOS token (a grammar needs one to end on)."""
    copy = tmp.mktemp("tiny-eos")
    for f in Path(tiny_model("llama")).iterdir():
        shutil.copy(f, copy / f.name)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": 0}))
    return str(copy)


def stream_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(20, 80))] for _ in range(n)]


def request(prompt: list[int], kind: dict) -> gen_pb.GenerateRequest:
    req = gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(**kind)
    )
    if kind is GRAMMAR:
        req.sampling.structured_outputs.regex = REGEX
    return req


def reference_params(kind: dict) -> SamplingParams:
    if kind is GRAMMAR:
        return SamplingParams(**kind, structured_outputs=StructuredOutputsParams(regex=REGEX))
    return SamplingParams(**kind)
