"""What crosses between the data-parallel front and its replicas, as JSON (never pickle):
sampling parameters in, step deltas and finished requests' outputs out. Each function pair
round-trips its value exactly (floats as JSON writes them: shortest repr)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pdmesh.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestError,
    RequestMetrics,
    RequestOutput,
    StepDelta,
)
from pdmesh.sampling_params import SamplingParams, StructuredOutputsParams


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    out = dataclasses.asdict(params)
    if params.logit_bias is not None:  # JSON object keys are strings
        out["logit_bias"] = [[k, v] for k, v in params.logit_bias.items()]
    return out


def params_from_json(raw: dict[str, Any]) -> SamplingParams:
    raw = dict(raw)
    if raw.get("logit_bias") is not None:
        raw["logit_bias"] = {int(k): float(v) for k, v in raw["logit_bias"]}
    if raw.get("structured_outputs") is not None:
        raw["structured_outputs"] = StructuredOutputsParams(**raw["structured_outputs"])
    raw["stop"] = tuple(raw["stop"])
    raw["stop_token_ids"] = tuple(raw["stop_token_ids"])
    return SamplingParams(**raw)


def _position_to_json(position: PositionLogprobs | None) -> list[list[Any]] | None:
    if position is None:
        return None
    return [[t, p.logprob, p.rank, p.decoded_token] for t, p in position.items()]


def _position_from_json(raw: list[list[Any]] | None) -> PositionLogprobs | None:
    if raw is None:
        return None
    return {int(t): Logprob(lp, rank, text) for t, lp, rank, text in raw}


def _positions_to_json(
    positions: list[PositionLogprobs] | list[PositionLogprobs | None] | None,
) -> list[Any] | None:
    return None if positions is None else [_position_to_json(p) for p in positions]


def _positions_from_json(raw: list[Any] | None) -> Any:
    return None if raw is None else [_position_from_json(p) for p in raw]


def delta_to_json(d: StepDelta) -> list[Any]:
    return [
        d.request_id,
        d.token_ids,
        d.text,
        d.finish_reason,
        _positions_to_json(d.logprobs),
        _positions_to_json(d.prompt_logprobs),
        d.index,
        d.request_finished,
    ]


def delta_from_json(raw: list[Any]) -> StepDelta:
    rid, ids, text, reason, lps, prompt_lps, index, finished = raw
    return StepDelta(
        rid, ids, text, reason, _positions_from_json(lps), _positions_from_json(prompt_lps),
        index, finished,
    )  # fmt: skip


def output_to_json(o: RequestOutput) -> dict[str, Any]:
    return {
        "request_id": o.request_id,
        "prompt": o.prompt,
        "prompt_token_ids": o.prompt_token_ids,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": _positions_to_json(c.logprobs),
            }
            for c in o.outputs
        ],
        "finished": o.finished,
        "num_cached_tokens": o.num_cached_tokens,
        "metrics": dataclasses.asdict(o.metrics) if o.metrics is not None else None,
        "prompt_logprobs": _positions_to_json(o.prompt_logprobs),
        "error": dataclasses.asdict(o.error) if o.error is not None else None,
    }


def output_from_json(raw: dict[str, Any]) -> RequestOutput:
    outputs = [
        CompletionOutput(**{**c, "logprobs": _positions_from_json(c["logprobs"])})
        for c in raw["outputs"]
    ]
    metrics = raw["metrics"]
    error = raw["error"]
    return RequestOutput(
        request_id=raw["request_id"],
        prompt=raw["prompt"],
        prompt_token_ids=raw["prompt_token_ids"],
        outputs=outputs,
        finished=raw["finished"],
        num_cached_tokens=raw["num_cached_tokens"],
        metrics=RequestMetrics(**metrics) if metrics is not None else None,
        prompt_logprobs=_positions_from_json(raw["prompt_logprobs"]),
        error=RequestError(**error) if error is not None else None,
    )
