"""The decode worker's KV connector: one receiver per tensor-parallel rank and transport in use,
each holding its rank's KV heads, and the scheduler side that reserves blocks for prompts a
prefill worker computes.

The transport is chosen per pair: `transport_for` names it for a prefill worker. Rank 0's
receivers live in its connector; each follower's connector holds that rank's and is driven by
control messages (`Expect`, `EndTransfer`, `DescribeEndpoints`), which rank 0 sends on the
engine thread because they are collectives over the worker's process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace

from pdmesh.kv_transfer.base import (
    KVReceiver,
    TransferError,
    TransferSpec,
    TransferStats,
)
from pdmesh.kv_transfer.connector import (
    KVBinding,
    KVConnector,
    control_message,
    register_connector,
)
from pdmesh.kv_transfer.registry import create_receiver, resolve_transport
from pdmesh.kv_transfer.stats import ReceiverStats, total_stats
from pdmesh.kv_transfer.target import KVEndpoint, KVTarget


@control_message
class ReceiveOptions:
    """transports: those this worker's pairs use, the default first (`auto` resolved for the
    cache's device). bind: where the first listens (the others bind a free port of its host).
    advertise: HOST or HOST:PORT prefill workers are told to push to (None: the bound address).
    transport_for: prefill worker host:port -> transport, for pairs not on the default."""

    transports: tuple[str, ...]
    bind: str
    advertise: str | None = None
    transport_for: Mapping[str, str] = field(default_factory=dict)

    def on_node(self, host: str, advertise: str | None) -> ReceiveOptions:
        """A follower on another node than rank 0's: rank 0's host is not one of its own, and
        each rank binds a free port (a HOST:PORT advertise keeps only its host)."""
        host_only = split_advertise(advertise)[0] if advertise else None
        return replace(self, bind=f"tcp://{host}:0", advertise=host_only, transport_for={})


@control_message
class Expect:
    transport: str
    spec: TransferSpec  # rank 0's: each follower expects its own heads
    timeout_s: float


@control_message
class EndTransfer:
    """Wait for a follower's heads of the transfer (TransferError if they do not come), or
    cancel them (timeout_s None)."""

    transfer_id: str
    timeout_s: float | None


@control_message
class DescribeEndpoints:
    """Asks a follower where its receivers listen; it replies `RankEndpoints`."""


@control_message
class RankEndpoints:
    endpoints: dict[str, KVEndpoint]  # transport -> that rank's receiver


def split_advertise(advertise: str) -> tuple[str, int | None]:
    """HOST or HOST:PORT (an IPv6 host in brackets) -> (host, port or None)."""
    host, sep, port = advertise.rpartition(":")
    if sep and port.isdigit() and (":" not in host or host.endswith("]")):
        return host, int(port)
    return advertise, None


def advertised(endpoint: str, advertise: str | None) -> str:
    """The endpoint prefill workers are told to push to: the bound one, with its host replaced
    by `advertise` (HOST), or host and port replaced (HOST:PORT, e.g. behind a port mapping)."""
    if advertise is None:
        return endpoint
    host, port = split_advertise(advertise)
    return f"tcp://{host}:{port if port is not None else endpoint.rsplit(':', 1)[1]}"


@dataclass(frozen=True)
class IncomingTransfer:
    """A transfer rank 0 announced: its spec, its transport, and rank 0's arrival."""

    spec: TransferSpec
    transport: str
    arrived: Future[TransferStats]


@register_connector(ReceiveOptions)
class ReceiveConnector(KVConnector):
    """Callers may rely on: `expect`, `cancel`, `transport_for`, `endpoints` and the stats from
    any thread once bound; `expect_followers`, `end_followers` and `bytes_moved` on the engine
    thread (no-ops without followers)."""

    receives = True

    def __init__(self, options: ReceiveOptions) -> None:
        self.options = options
        self.receivers: dict[str, KVReceiver] = {}
        self._endpoints: dict[str, list[KVEndpoint]] = {}
        self._default = ""
        self._transport_for: dict[str, str] = {}
        self._futures: dict[str, tuple[KVReceiver, Future[TransferStats]]] = {}  # followers'

    # -- the connector interface --------------------------------------------------------------
    def bind(self, binding: KVBinding) -> None:
        super().bind(binding)
        cache, geometry = binding.cache, binding.geometry
        resolved = [resolve_transport(n, cache.device) for n in self.options.transports]
        self._default = resolved[0]
        self._transport_for = {
            address: resolve_transport(name, cache.device)
            for address, name in self.options.transport_for.items()
        }
        any_port = f"{self.options.bind.rsplit(':', 1)[0]}:0"  # of the first receiver's host
        try:
            for name in dict.fromkeys(resolved):
                at = any_port if self.receivers else self.options.bind
                self.receivers[name] = create_receiver(name, cache, geometry, at)
        except BaseException:
            self.close()
            raise
        # A HOST:PORT advertise is the first (default) receiver's port mapping; the others keep
        # their ports.
        advertise = self.options.advertise
        host = split_advertise(advertise)[0] if advertise else None
        for i, (name, r) in enumerate(self.receivers.items()):
            address = advertised(r.endpoint, advertise if i == 0 else host)
            g = geometry
            self._endpoints[name] = [
                KVEndpoint(address, g.head_start, g.num_kv_heads, g.layer_start, g.num_layers)
            ]
        # While the engine is built: no engine thread yet.
        for reply in self.tell_followers(DescribeEndpoints()):
            assert isinstance(reply, RankEndpoints)
            for name, endpoint in reply.endpoints.items():
                self._endpoints[name].append(endpoint)

    def follower_options(self) -> ReceiveOptions:
        """Every other rank binds a port of its own: only the advertised host is shared."""
        advertise = self.options.advertise
        host = split_advertise(advertise)[0] if advertise else None
        any_port = f"{self.options.bind.rsplit(':', 1)[0]}:0"  # rank 0's port is taken (--kv-port)
        return replace(self.options, bind=any_port, advertise=host, transport_for={})

    def handle(self, message: object) -> object | None:
        match message:
            case DescribeEndpoints():
                return RankEndpoints({name: eps[0] for name, eps in self._endpoints.items()})
            case Expect(transport, spec, timeout_s):
                g = self.geometry
                spec = replace(spec, head_start=g.head_start, num_heads=g.num_kv_heads)
                receiver = self.receivers[transport]
                self._futures[spec.transfer_id] = receiver, receiver.expect(spec, timeout_s)
            case EndTransfer(transfer_id, None):
                entry = self._futures.pop(transfer_id, None)
                if entry is not None:
                    entry[0].cancel(transfer_id)
            case EndTransfer(transfer_id, timeout_s):
                self._await(transfer_id, timeout_s)
            case _:
                return super().handle(message)
        return None

    def _await(self, transfer_id: str, timeout_s: float) -> None:
        entry = self._futures.pop(transfer_id, None)
        if entry is None:
            raise TransferError(f"unknown transfer {transfer_id}")
        receiver, future = entry
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            receiver.cancel(transfer_id)
            raise TransferError(f"transfer {transfer_id} timed out") from None
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(str(e)) from e

    def close(self) -> None:
        for r in self.receivers.values():
            r.close()

    # -- rank 0, any thread -------------------------------------------------------------------
    def transport_for(self, prefill_address: str) -> str:
        """The transport of the pair with the prefill worker at `prefill_address`."""
        return self._transport_for.get(prefill_address, self._default)

    def endpoints(self, transport: str) -> tuple[KVEndpoint, ...]:
        """Every rank's receiver of `transport`, rank 0 first."""
        return tuple(self._endpoints[transport])

    @property
    def addresses(self) -> dict[str, str]:
        """Rank 0's advertised address per transport."""
        return {name: eps[0].address for name, eps in self._endpoints.items()}

    def target(
        self,
        transfer: IncomingTransfer,
        first_block: int,
        timeout_s: float,
        trace_context: dict[str, str],
    ) -> KVTarget:
        """Where a sender pushes `transfer` (its blocks hold the prompt's from `first_block`):
        what a Prefill or Migrate call carries."""
        spec = transfer.spec
        return KVTarget(
            transfer.transport,
            spec.transfer_id,
            spec.token,
            first_block,
            spec.block_ids,
            self.geometry.block_size,
            self.endpoints(transfer.transport),
            timeout_s,
            trace_context,
        )

    def expect(self, transport: str, block_ids: list[int], timeout_s: float) -> IncomingTransfer:
        """Announce a transfer to rank 0's receiver."""
        g = self.geometry
        spec = TransferSpec.new(block_ids, g.head_start, g.num_kv_heads)
        return IncomingTransfer(
            spec, transport, self.receivers[transport].expect(spec, timeout=timeout_s)
        )

    def cancel(self, transfer: IncomingTransfer) -> None:
        self.receivers[transfer.transport].cancel(transfer.spec.transfer_id)

    @property
    def stats(self) -> ReceiverStats:
        """This rank's counters over its transports (thread-safe)."""
        return total_stats(ReceiverStats, self.stats_by_transport().values())

    def stats_by_transport(self) -> dict[str, ReceiverStats]:
        return {name: r.stats for name, r in self.receivers.items()}

    def bytes_here(self) -> int:
        return self.stats.bytes_received

    # -- rank 0, engine thread ----------------------------------------------------------------
    def expect_followers(self, transfer: IncomingTransfer, timeout_s: float) -> None:
        self.tell_followers(Expect(transfer.transport, transfer.spec, timeout_s))

    def end_followers(self, transfer: IncomingTransfer, timeout_s: float | None) -> None:
        """Wait until every other rank has its heads of the transfer (TransferError if not), or
        with timeout_s None cancel it there."""
        self.tell_followers(EndTransfer(transfer.spec.transfer_id, timeout_s))
