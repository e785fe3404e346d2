"""The router's view of a KV store (`--kvstore HOST:PORT`): how many leading blocks of a prompt
the store holds, for the KV-aware policy to count as cheaper than a miss (router/policies).

The router does not know the model's KV geometry; the store says it (its first Put sets it), so
the lookup client is built once the store has one. Until then, and whenever the store is slow or
down, every prompt counts 0 store blocks: dispatch never waits for the store longer than
`timeout_s`, and the client leaves a failing store alone for a while (client.py). Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdmesh.kvstore_service.client import KVStoreClient, store_geometry
from pdmesh.serving.tls import TLSConfig

GEOMETRY_RETRY_S = 2.0


class StoreHits:
    """Callers may rely on: `blocks` never raises and returns within about `timeout_s`; call it
    and `close` on one event loop."""

    def __init__(self, target: str, tls: TLSConfig | None = None, timeout_s: float = 0.1) -> None:
        self.target = target
        self.tls = tls
        self.timeout_s = timeout_s
        self._client: KVStoreClient | None = None
        self._next_try = 0.0  # time.monotonic() of the next GetStats for the geometry

    async def blocks(self, prompt_ids: Sequence[int]) -> int:
        """Leading full blocks of the prompt (all but its last token, which a worker always
        computes) the store holds now; 0 when it holds none, has no geometry yet, or fails."""
        client = self._client or await self._connect()
        if client is None:
            return 0
        return await client.lookup(list(prompt_ids[:-1]))

    async def _connect(self) -> KVStoreClient | None:
        now = time.monotonic()
        if now < self._next_try:
            return None
        self._next_try = now + GEOMETRY_RETRY_S
        geometry = await store_geometry(self.target, timeout_s=self.timeout_s, tls=self.tls)
        if geometry is not None:
            self._client = KVStoreClient(
                self.target, geometry, timeout_s=self.timeout_s, tls=self.tls
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
