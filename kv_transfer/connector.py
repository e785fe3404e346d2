"""The KV connector: the one seam between the engine and the KV plane (docs/architecture.md).

The engine knows this module and nothing else of the KV plane; a service hands the engine a
connector (`LLMEngine(config, kv_connector=...)`) and every rank of the worker runs one. Two
sides, as vLLM's KV connector:

- scheduler side, rank 0 on the engine thread: `plan_step` says what a step moves (its plan
  travels with the step to every rank); `reserve` / `commit` / `release` handle prompts whose
  KV comes from elsewhere.
- worker side, every rank (tensor-parallel followers included): `bind` once to the rank's KV
  cache, then for a step with a plan `start_step(plan)` before the forward, `save_layer(layer)`
  right after each attention layer stored its K/V, `end_step()` after the forward; `handle`
  runs a control message from rank 0.

Rank 0 and its followers talk in control messages: frozen dataclasses registered with
`@control_message`, one JSON codec (`encode` / `decode`, no pickle), one error convention (a
follower's exception comes back as a `Failed` reply, and `raise_failures` raises it on rank 0 as
the same kind: TransferError, ValueError, else RuntimeError). This module imports nothing from
the engine: what it needs of the engine is described by the protocols below.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from pdmesh.kv_transfer.base import TransferError
from pdmesh.kv_transfer.geometry import PageGeometry
from pdmesh.kv_transfer.stats import ReceiverStats, SenderStats

T = TypeVar("T")


# -- geometry -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVHeads:
    """Which global KV heads a tensor-parallel rank holds."""

    start: int  # first global KV head held by this rank
    count: int  # heads held
    total: int  # the model's KV heads
    replicas: int  # ranks holding each head (> 1 when there are fewer KV heads than ranks)
    rank: int

    @property
    def sends(self) -> bool:
        """Whether this rank pushes its heads: one rank per replicated head does."""
        return self.rank % self.replicas == 0

    @staticmethod
    def of_rank(total: int, rank: int, size: int) -> KVHeads:
        """Rank `rank` of `size`'s heads: an equal share, or one head replicated over
        `size / total` ranks when there are fewer heads than ranks (as the QKV projection
        splits them)."""
        if total >= size:
            count = total // size
            return KVHeads(rank * count, count, total, 1, rank)
        replicas = size // total
        return KVHeads(rank // replicas, 1, total, replicas, rank)


class ControlChannel(Protocol):
    """Rank 0's line to its followers (engine thread, between steps)."""

    def call(self, message: object) -> list[object | None]:
        """Run `message` on every follower; their replies, rank 1 first. A follower's failure
        is raised here (see `raise_failures`)."""
        ...


@dataclass(frozen=True)
class KVBinding:
    """What the engine gives a connector on each rank once the KV cache exists."""

    cache: torch.Tensor  # [num_layers, 2 (k, v), num_blocks, block_size, heads.count, head_dim]
    heads: KVHeads
    followers: ControlChannel | None = None  # rank 0 of a tensor-parallel worker only
    layer_start: int = 0  # the global layer of cache index 0 (a pipeline stage's first)

    @property
    def geometry(self) -> PageGeometry:
        layers, _, _, block_size, count, head_dim = self.cache.shape
        heads, dtype = self.heads.start, self.cache.dtype
        return PageGeometry(layers, block_size, count, heads, head_dim, dtype, self.layer_start)


# -- what the scheduler side reads of the engine -------------------------------------------------
class StepSeq(Protocol):
    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    block_table: list[int]


class StepBatch(Protocol):
    """A scheduled step: run `num_new_tokens[i]` tokens of `seqs[i]`."""

    seqs: Sequence[StepSeq]
    num_new_tokens: Sequence[int]


class PrefillHost(Protocol):
    """The engine's public methods for prompts prefilled elsewhere (LLMEngine has them)."""

    def cached_prefix_tokens(self, prompt: list[int]) -> int: ...
    def reserve_prefill(
        self, request_id: str, prompt: list[int], params: Any, num_output_tokens: int = 0
    ) -> ExternalBlocks | None: ...
    def commit_prefill(self, request_id: str, first: Any, defer_caching: bool = False) -> Any: ...
    def release_prefill(self, request_id: str) -> None: ...
    def is_reserved(self, request_id: str) -> bool: ...


@dataclass(frozen=True)
class ExternalBlocks:
    """Blocks reserved for a prompt whose KV another worker computes."""

    first_block: int  # prompt blocks already here (prefix cache): not to be sent
    block_ids: list[int]  # this worker's blocks for the rest of the prompt, in order
    uncached_tokens: int


# -- the interface ------------------------------------------------------------------------------
class KVConnector:
    """The engine's view of the KV plane (a base class: every method has a default).

    Callers may rely on: the engine calls `bind` once per rank before any step; `plan_step` only
    on rank 0, on the engine thread, once per step; `start_step` / `save_layer` / `end_step` on
    every rank in that order for each step whose plan is not None (steps without a plan call
    none of them, and may replay CUDA graphs); `handle` on a follower between steps. A connector
    never raises out of `save_layer` for a transfer that failed: the failure surfaces where the
    service waits for the transfer.
    """

    options: object
    # Set by `bind`: this rank's cache and geometry; on rank 0 of a tensor-parallel worker, the
    # other ranks.
    binding: KVBinding
    geometry: PageGeometry
    followers: ControlChannel | None = None

    def follower_options(self) -> object:
        """What each follower rank builds its connector from (`create_connector`)."""
        return self.options

    def tell_followers(self, message: object) -> list[object | None]:
        """Rank 0, engine thread: `message` run on every follower, their replies ([] without
        followers). A follower's failure is raised here."""
        return self.followers.call(message) if self.followers is not None else []

    def bytes_moved(self) -> int:
        """Rank 0, engine thread: KV bytes sent or received by every rank."""
        replies = self.tell_followers(CountBytes())
        return self.bytes_here() + sum(r.value for r in replies if isinstance(r, Count))

    def bytes_here(self) -> int:
        """KV bytes this rank sent or received (any thread)."""
        return 0

    def stats_by_transport(self) -> Mapping[str, SenderStats | ReceiverStats]:
        """This rank's counters per transport in use (any thread)."""
        return {}

    # -- scheduler side (rank 0, engine thread) -----------------------------------------------
    plans_steps = False  # steps carry plans: the engine then launches them one at a time
    receives = False  # prompts' KV may come from elsewhere (`reserve`)

    def plan_step(self, batch: StepBatch) -> torch.Tensor | None:
        """The step's plan (flat int64 that this connector alone reads), sent to every rank; None:
        the step moves no KV."""
        return None

    def reserve(
        self,
        engine: PrefillHost,
        request_id: str,
        prompt: list[int],
        params: Any,
        num_output_tokens: int,
        min_tokens: int,
    ) -> ExternalBlocks | None:
        """Blocks for a prompt whose KV will come from elsewhere, or None: compute it here
        (this connector receives nothing, too few uncached tokens, or no blocks now)."""
        uncached = len(prompt) - engine.cached_prefix_tokens(prompt) if self.receives else 0
        if uncached < max(1, min_tokens):
            return None
        return engine.reserve_prefill(
            request_id, prompt, params, num_output_tokens=num_output_tokens
        )

    def commit(self, engine: PrefillHost, request_id: str, first: Any) -> Any | None:
        """The reserved prompt's KV arrived and its first token was sampled (`first`: the
        engine's record of it, a token per sequence): the engine's deltas (one per sequence),
        or None when the request was aborted meanwhile."""
        if not engine.is_reserved(request_id):
            return None
        # The prompt's blocks join the prefix cache after the next step: TTFT.
        return engine.commit_prefill(request_id, first, defer_caching=True)

    def release(self, engine: PrefillHost, request_id: str) -> bool:
        """The KV will not come: free the reservation and queue the prompt to be computed here.
        False when the request was aborted meanwhile."""
        if not engine.is_reserved(request_id):
            return False
        engine.release_prefill(request_id)
        return True

    # -- worker side (every rank) -------------------------------------------------------------
    def bind(self, binding: KVBinding) -> None:
        """Attach to this rank's KV cache (once, before any step)."""
        self.binding, self.geometry, self.followers = binding, binding.geometry, binding.followers

    def start_step(self, plan: torch.Tensor) -> None:
        """Before the forward of a step with a plan (load / wait would go here)."""

    def save_layer(self, layer: int) -> None:
        """Right after attention layer `layer` stored the step's K/V."""

    def end_step(self) -> None:
        """After the forward of a step with a plan."""

    def handle(self, message: object) -> object | None:
        """A follower runs a control message from rank 0; its reply (a control message or
        None). Raise to fail it: rank 0 raises the same kind."""
        if isinstance(message, CountBytes):
            return Count(self.bytes_here())
        raise RuntimeError(f"{type(self).__name__} has no control message {message!r}")

    def close(self) -> None:
        """Stop transfers and release transports. Idempotent."""


_CONNECTORS: dict[type, Callable[[Any], KVConnector]] = {}


def register_connector(options: type) -> Callable[[type[T]], type[T]]:
    """Register a connector class built from an `options` control message."""

    def register(cls: type[T]) -> type[T]:
        _CONNECTORS[options] = cls  # type: ignore[assignment]
        return cls

    return register


def create_connector(options: object) -> KVConnector:
    """The connector a follower rank runs for rank 0's `options`."""
    try:
        return _CONNECTORS[type(options)](options)
    except KeyError:
        raise ValueError(f"no KV connector is registered for {type(options).__name__}") from None


def on_node(options: object, host: str, advertise: str | None) -> object:
    """Rank 0's connector `options` for a follower rank on another node (a multi-node worker):
    whatever it binds binds `host` on a free port and advertises `advertise` (a HOST; None: the
    bound address). Options whose class has no `on_node(host, advertise)` bind nothing and are
    returned as they are."""
    move = getattr(options, "on_node", None)
    return options if move is None else move(host, advertise)


# -- control messages ---------------------------------------------------------------------------
_MESSAGES: dict[str, type] = {}


@typing.dataclass_transform(frozen_default=True)
def control_message(cls: type[T]) -> type[T]:
    """Make `cls` a frozen dataclass and register it as a control message (by class name:
    names are unique)."""
    if cls.__name__ in _MESSAGES:
        raise ValueError(f"control message {cls.__name__} is registered twice")
    _MESSAGES[cls.__name__] = message = dataclass(frozen=True)(cls)
    return message


@control_message
class Failed:
    """A follower's reply when it could not run a message."""

    KINDS: ClassVar[dict[str, type[Exception]]] = {
        "TransferError": TransferError,
        "ValueError": ValueError,
    }
    kind: str  # "TransferError", "ValueError" or "RuntimeError"
    message: str

    @staticmethod
    def of(exc: Exception) -> Failed:
        kind = next((k for k, t in Failed.KINDS.items() if isinstance(exc, t)), "RuntimeError")
        return Failed(kind, f"{type(exc).__name__}: {exc}")


@control_message
class CountBytes:
    """Asks a follower for its connector's `bytes_here`; it replies `Count`."""


@control_message
class Count:
    """A follower's reply that is one number."""

    value: int


def raise_failures(replies: list[object | None]) -> list[object | None]:
    """`replies` (rank 1 first) unless one is `Failed`: then its kind, raised on rank 0."""
    for rank, reply in enumerate(replies, start=1):
        if isinstance(reply, Failed):
            kind = Failed.KINDS.get(reply.kind, RuntimeError)
            raise kind(f"tensor-parallel rank {rank}: {reply.message}")
    return replies


def _from_json(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bytes:
        return bytes.fromhex(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{k: _from_json(hints[k], v) for k, v in value.items()})
    if origin in (tuple, list):
        return origin(_from_json(args[0], v) for v in value)
    if origin is dict:
        return {k: _from_json(args[1], v) for k, v in value.items()}
    if value is not None and args and type(None) in args:  # X | None
        return _from_json(next(a for a in args if a is not type(None)), value)
    return value


def encode(message: object | None) -> bytes:
    """A control message (or None) as JSON: its class name and its fields."""
    if message is None:
        return b""
    name = type(message).__name__
    if _MESSAGES.get(name) is not type(message):
        raise TypeError(f"{name} is not a registered control message")
    # asdict recurses into nested messages; bytes travel as hex.
    fields = dataclasses.asdict(message)  # type: ignore[call-overload]
    return json.dumps({"type": name, "fields": fields}, default=bytes.hex).encode()


def decode(data: bytes) -> object | None:
    """The message `encode` made; ValueError for an unknown type."""
    if not data:
        return None
    raw = json.loads(data)
    cls = _MESSAGES.get(raw["type"])
    if cls is None:
        raise ValueError(f"unknown control message {raw['type']!r}")
    return _from_json(cls, raw["fields"])
