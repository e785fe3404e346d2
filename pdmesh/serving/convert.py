"""Protobuf <-> domain objects, at the edge only (the engine never sees protobuf)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pdmesh.errors import InvalidRequest
from pdmesh.json_input import parse_json
from pdmesh.sampling_params import SamplingParams, StructuredOutputsParams
from pdmesh.v1 import generation_pb2 as gen_pb
from pdmesh.validation import check_stop_rules

FINISH_TO_PB = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    "stop": gen_pb.FINISH_REASON_STOP,
    "length": gen_pb.FINISH_REASON_LENGTH,
    "abort": gen_pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}
# The engine ends a request early with "error" (RequestOutput.error): on the wire that is an
# abort whose status names the error.
FINISH_TO_PB["error"] = gen_pb.FINISH_REASON_ABORT

E = TypeVar("E")

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
)


def sampling_fields_from_pb(pb: gen_pb.SamplingParams) -> dict[str, Any]:
    """The SamplingParams arguments a message sets (an unset field is absent: its default
    applies), not yet checked."""
    kwargs = {name: getattr(pb, name) for name in _OPTIONAL_FIELDS if pb.HasField(name)}
    kwargs["stop"] = tuple(pb.stop)
    kwargs["stop_token_ids"] = tuple(pb.stop_token_ids)
    kwargs["ignore_eos"] = pb.ignore_eos
    if pb.logit_bias:
        kwargs["logit_bias"] = dict(pb.logit_bias)
    if pb.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_pb(pb.structured_outputs)
    return kwargs


def structured_from_pb(pb: gen_pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest(
            "structured_outputs must set one of json, json_object, regex, choice and grammar.",
            "structured_outputs",
        )
    if kind == "json":
        return StructuredOutputsParams(json=parse_json(pb.json, "structured_outputs.json"))
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(pb.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(pb, kind)})


def structured_to_pb(so: StructuredOutputsParams) -> gen_pb.StructuredOutputs:
    kind = so.kind
    if kind == "json":
        text = so.json if isinstance(so.json, str) else json.dumps(so.json)
        return gen_pb.StructuredOutputs(json=text)
    if kind == "choice":
        return gen_pb.StructuredOutputs(choice=gen_pb.Choices(choices=list(so.choice or ())))
    return gen_pb.StructuredOutputs(**{kind: getattr(so, kind)})


def sampling_from_pb(pb: gen_pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the wire; InvalidRequest naming the field for a broken rule."""
    kwargs = sampling_fields_from_pb(pb)
    check_stop_rules(kwargs["stop"], kwargs["stop_token_ids"])
    return SamplingParams(**kwargs)


def sampling_to_pb(params: SamplingParams) -> gen_pb.SamplingParams:
    pb = gen_pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
    )
    if params.seed is not None:
        pb.seed = params.seed
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        setattr(pb, name, getattr(params, name))
    for name in ("logprobs", "prompt_logprobs", "best_of"):
        if getattr(params, name) is not None:
            setattr(pb, name, getattr(params, name))
    if params.n != 1:
        pb.n = params.n
    if params.logit_bias:
        pb.logit_bias.update(params.logit_bias)
    if params.structured_outputs is not None:
        pb.structured_outputs.CopyFrom(structured_to_pb(params.structured_outputs))
    return pb


def logprobs_to_pb(position: Mapping[int, Any]) -> gen_pb.PositionLogprobs:
    """One position's entries (token id -> an object with `logprob` and `rank`, the token
    there first) as the wire message, in the same order."""
    return gen_pb.PositionLogprobs(
        token_ids=list(position),
        logprobs=[e.logprob for e in position.values()],
        ranks=[e.rank for e in position.values()],
    )


def prompt_logprobs_to_pb(
    entries: Sequence[Mapping[int, Any] | None],
) -> list[gen_pb.PositionLogprobs]:
    """A prompt's entries (None for the first token, which nothing predicts) as the wire
    carries them: one per prompt token after the first."""
    return [logprobs_to_pb(p) for p in entries[1:] if p is not None]


def prompt_logprobs_from_pb(
    pbs: Sequence[gen_pb.PositionLogprobs], num_prompt_tokens: int, entry: Callable[[float, int], E]
) -> list[dict[int, E] | None] | None:
    """The inverse of prompt_logprobs_to_pb; None when the count does not fit the prompt."""
    if len(pbs) != num_prompt_tokens - 1:
        return None
    return [None, *(logprobs_from_pb(p, entry) for p in pbs)]


def logprobs_from_pb(pb: gen_pb.PositionLogprobs, entry: Callable[[float, int], E]) -> dict[int, E]:
    """The entries of one position, each made by `entry(logprob, rank)`, in wire order."""
    return {t: entry(lp, r) for t, lp, r in zip(pb.token_ids, pb.logprobs, pb.ranks, strict=True)}
