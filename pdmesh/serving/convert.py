"""Protobuf <-> domain objects, at the edge only (the engine never sees protobuf)."""

from __future__ import annotations

from typing import Any

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.v1 import generation_pb2 as gen_pb

FINISH_TO_PB = {
    None: gen_pb.FINISH_REASON_UNSPECIFIED,
    "stop": gen_pb.FINISH_REASON_STOP,
    "length": gen_pb.FINISH_REASON_LENGTH,
    "abort": gen_pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}

# Largest integers accepted on the wire before SamplingParams checks ranges.
_MAX_INT = 2**63 - 1
# Stop rules are checked at every token of a request, on the engine thread: bounded so that no
# request can make every step of its batch slow.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def check_stop_rules(stop: tuple[str, ...], stop_token_ids: tuple[int, ...]) -> None:
    """ValueError when the stop rules are larger than a request may have."""
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ValueError(
            f"stop must be at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
            "characters each."
        )
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} entries.")


def sampling_from_pb(
    pb: gen_pb.SamplingParams, max_tokens_cap: int | None = None
) -> SamplingParams:
    """SamplingParams from the wire; unset fields take the defaults. Raises ValueError."""
    kwargs: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_k", "top_p", "seed", "skip_special_tokens"):
        if pb.HasField(name):
            kwargs[name] = getattr(pb, name)
    if (
        "max_tokens" in kwargs
        and max_tokens_cap is not None
        and kwargs["max_tokens"] > max_tokens_cap
    ):
        raise ValueError(
            f"max_tokens must be at most {max_tokens_cap} (the model's max length), "
            f"got {kwargs['max_tokens']}."
        )
    kwargs["stop"] = tuple(pb.stop)
    kwargs["stop_token_ids"] = tuple(pb.stop_token_ids)
    check_stop_rules(kwargs["stop"], kwargs["stop_token_ids"])
    kwargs["ignore_eos"] = pb.ignore_eos
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
    return pb


def worker_stat_fields(e: Any) -> dict[str, int]:
    """An engine's EngineStats under the names workers report them by (the WorkerStats message
    and the metrics snapshot share them)."""
    return {
        "num_running": e.num_running,
        "num_waiting": e.num_waiting,
        "kv_blocks_total": e.num_blocks_total,
        "kv_blocks_used": e.num_blocks_used,
        "kv_blocks_free": e.num_blocks_free,
        "prefix_queried_tokens": e.prefix_queried_tokens,
        "prefix_hit_tokens": e.prefix_hit_tokens,
        "num_preemptions": e.num_preemptions,
        "steps_launched_ahead": e.steps_launched_ahead,
    }
