"""Which KV heads a rank holds, as the KV-transfer layer needs to know."""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class KVHeads:
    start: int  # first global KV head held by this rank
    count: int  # heads held
    total: int  # the model's KV heads
    replicas: int  # ranks holding each head (> 1 when there are fewer KV heads than ranks)
    rank: int

    @property
    def sends(self) -> bool:
        """Whether this rank pushes its heads: one rank per replicated head does."""
        return self.rank % self.replicas == 0


def kv_heads(runner: ModelRunner) -> KVHeads:
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    tp = runner.tp
    total = runner.info.num_kv_heads
    replicas = tp.size // total if tp.size > total else 1
    return KVHeads(qkv.kv_head_start, qkv.num_kv_heads, total, replicas, tp.rank)
