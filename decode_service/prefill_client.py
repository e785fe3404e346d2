"""The decode worker's client of prefill workers (the KV-transfer control plane)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from pdmesh.engine.sampling_params import SamplingParams
from pdmesh.kv_transfer import TransferSpec
from pdmesh.serving.convert import sampling_to_pb
from pdmesh.serving.grpc_server import channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


@dataclass(frozen=True)
class KVDestination:
    """One decode rank's receiver: its address and the KV heads it holds."""

    address: str
    head_start: int
    num_heads: int


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    cached_prompt_tokens: int
    prefill_ns: int
    kv_bytes: int


class PrefillClient:
    def __init__(self, tls: TLSConfig | None = None) -> None:
        self._tls = tls
        self._stubs: dict[str, worker_pb2_grpc.PrefillWorkerStub] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = channel(address, self._tls)
            self._channels.append(ch)
            stub = self._stubs[address] = worker_pb2_grpc.PrefillWorkerStub(ch)
        return stub

    async def prefill(
        self,
        address: str,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        spec: TransferSpec,
        first_block: int,
        block_size: int,
        destinations: list[KVDestination],
        transport: str,
        timeout_s: float,
        trace_context: dict[str, str] | None = None,
    ) -> PrefillResult:
        target = worker_pb2.KVTarget(
            transport=transport,
            transfer_id=spec.transfer_id,
            token=spec.token,
            first_block=first_block,
            block_ids=list(spec.block_ids),
            block_size=block_size,
            endpoints=[
                worker_pb2.KVEndpoint(
                    address=d.address, head_start=d.head_start, num_heads=d.num_heads
                )
                for d in destinations
            ],
            timeout_ms=int(timeout_s * 1000),
            trace_context=trace_context or {},
        )
        request = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling_to_pb(params),
            kv_target=target,
        )
        reply = await self._stub(address).Prefill(request, timeout=timeout_s)
        return PrefillResult(
            first_token=reply.first_token_id,
            cached_prompt_tokens=reply.cached_prompt_tokens,
            prefill_ns=reply.prefill_ns,
            kv_bytes=reply.kv_bytes,
        )

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
