"""The KV connector of a worker that takes either role (`pdmesh worker`, vLLM's `kv_both`):
it receives prompts' KV as a decode worker's `ReceiveConnector` does, and pushes the prompts it
prefills as a prefill worker's `PushConnector` does, over one KV cache.

It is a `ReceiveConnector` (a decode worker's code takes it as one) holding a `PushConnector`
(`push`, bound to the same cache) that a prefill role drives. Steps carry KV plans only while a
push is planned, so a worker serving decode keeps the async lookahead of a decode worker.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pdmesh.kv_transfer.connector import (
    KVBinding,
    StepBatch,
    control_message,
    register_connector,
)
from pdmesh.kv_transfer.push_connector import PushConnector, PushEnd, PushStart
from pdmesh.kv_transfer.receive_connector import ReceiveConnector, ReceiveOptions


@control_message
class PushReceiveOptions:
    """A receiving side as a decode worker's (`receive`); the pushing side needs no settings."""

    receive: ReceiveOptions

    def on_node(self, host: str, advertise: str | None) -> PushReceiveOptions:
        return replace(self, receive=self.receive.on_node(host, advertise))


@register_connector(PushReceiveOptions)
class PushReceiveConnector(ReceiveConnector):
    """Callers may rely on: what `ReceiveConnector` promises, and `push` as a `PushConnector`
    bound to the same cache. `stats_by_transport` and `bytes_here` are the receiving side's;
    `push` has the sending side's."""

    def __init__(self, options: PushReceiveOptions) -> None:
        super().__init__(options.receive)
        self.push = PushConnector()

    @property
    def plans_steps(self) -> bool:  # type: ignore[override]
        return self.push.pushing

    def follower_options(self) -> PushReceiveOptions:
        return PushReceiveOptions(super().follower_options())

    def bind(self, binding: KVBinding) -> None:
        super().bind(binding)
        self.push.bind(binding)

    def plan_step(self, batch: StepBatch) -> torch.Tensor | None:
        return self.push.plan_step(batch)

    def start_step(self, plan: torch.Tensor) -> None:
        self.push.start_step(plan)

    def save_layer(self, layer: int) -> None:
        self.push.save_layer(layer)

    def end_step(self) -> None:
        self.push.end_step()

    def handle(self, message: object) -> object | None:
        if isinstance(message, PushStart | PushEnd):
            return self.push.handle(message)
        return super().handle(message)

    def close(self) -> None:
        super().close()
        self.push.close()
