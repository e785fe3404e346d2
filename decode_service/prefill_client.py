"""The decode worker's client of prefill workers (the KV-transfer control plane)."""

from __future__ import annotations

import grpc

from pdmesh.engine.outputs import FirstTokens, Logprob
from pdmesh.kv_transfer.target import KVTarget
from pdmesh.sampling_params import SamplingParams
from pdmesh.serving.convert import logprobs_from_pb, prompt_logprobs_from_pb, sampling_to_pb
from pdmesh.serving.grpc_server import channel
from pdmesh.serving.tls import TLSConfig
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


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
        target: KVTarget,
    ) -> FirstTokens:
        """Have the prefill worker at `address` compute the prompt into `target` (the call's
        deadline is the target's timeout); the prompt's first token (one per choice) and the
        log-probabilities the request asks for."""
        request = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling=sampling_to_pb(params),
            kv_target=target.to_pb(),
        )
        reply = await self._stub(address).Prefill(request, timeout=target.timeout_s)
        return FirstTokens(
            list(reply.first_token_ids) or [reply.first_token_id],
            [logprobs_from_pb(p, Logprob) for p in reply.first_token_logprobs] or None,
            prompt_logprobs_from_pb(reply.prompt_logprobs, len(prompt), Logprob)
            if params.prompt_logprobs is not None
            else None,
        )

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
