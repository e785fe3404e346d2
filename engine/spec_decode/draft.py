"""The draft-model proposer: a smaller model sharing the target's tokenizer proposes k tokens
greedily (deterministic, as spec_verify.py's exactness argument needs).

It runs on rank 0 in a `ModelRunner` of its own (one rank: no tensor parallelism), with a paged
KV cache and a block manager of its own (no prefix caching), sized as the target's. Each
sequence that speculates has a mirror sequence here: before proposing, the mirror takes the
target's tokens; KV computed past the longest common prefix (drafts the target rejected) is
rolled back (`BlockManager.trim`). Proposing is then one step over every mirror's uncomputed
tokens (often the last draft accepted plus the target's token) and k - 1 one-token steps, each
batched over the sequences. A sequence that ends or leaves the running batch loses its mirror.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pdmesh.checkpoint.source import resolve_model_folder
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.kv_cache.block_manager import BlockManager
from pdmesh.engine.models.info import ModelInfo
from pdmesh.engine.runner.model_runner import ModelRunner
from pdmesh.engine.scheduling.batch import ScheduledBatch
from pdmesh.engine.sequence import Sequence
from pdmesh.engine.spec_decode.config import SpeculativeConfig
from pdmesh.engine.spec_decode.speculator import Proposer, register_proposer
from pdmesh.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0, max_tokens=1 << 30, ignore_eos=True)


def check_draft(draft: ModelInfo, target: ModelInfo) -> None:
    """The draft must speak the target's tokens: the same vocabulary size and EOS ids."""
    if draft.vocab_size != target.vocab_size or draft.eos_token_ids != target.eos_token_ids:
        raise ValueError(
            "speculative_config.model must share the target's tokenizer: its vocabulary has "
            f"{draft.vocab_size} tokens (EOS {list(draft.eos_token_ids)}), the target's "
            f"{target.vocab_size} (EOS {list(target.eos_token_ids)})."
        )


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        target: ModelInfo,
        engine_config: EngineConfig,
        device: torch.device,
        capacity_tokens: int,
        **_: Any,
    ) -> None:
        assert config.model is not None
        self.info = ModelInfo.load(resolve_model_folder(config.model))
        check_draft(self.info, target)
        draft_config = dataclasses.replace(
            engine_config,
            model=config.model,
            speculative_config=None,
            tensor_parallel_size=1,
            kv_cache_tokens=capacity_tokens,
            kv_offload_gib=0.0,
            enable_prefix_caching=False,
            enable_eplb=False,
            enable_expert_parallel=False,
            num_redundant_experts=0,
        )
        max_len = min(capacity_tokens, self.info.max_position)
        self.runner = ModelRunner(self.info, draft_config, device, max_len)
        self.blocks = BlockManager(self.runner.num_blocks, draft_config.block_size, False)
        self._mirrors: dict[int, tuple[Sequence, Sequence]] = {}  # id(target seq) -> both

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        live = {id(s) for s in seqs}
        for key in [k for k in self._mirrors if k not in live]:
            self.blocks.free(self._mirrors.pop(key)[1])  # ended or left the batch
        mirrors = [self._sync(s) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        for j in range(max(limits, default=0)):
            rows = [i for i, k in enumerate(limits) if k > j and mirrors[i] is not None]
            counts = []
            for i in list(rows):
                m = mirrors[i]
                assert m is not None
                if j:
                    m.token_ids.append(drafts[i][-1])
                n = m.num_uncomputed_tokens
                if not self.blocks.can_allocate(m, n):
                    rows.remove(i)  # out of draft blocks: this sequence proposes no more
                    continue
                self.blocks.allocate(m, n)
                counts.append(n)
            if not rows:
                break
            batch = ScheduledBatch([mirrors[i] for i in rows], counts, [])  # type: ignore[misc]
            tokens = self.runner.collect(self.runner.launch(batch))
            for i, m, n, token in zip(rows, batch.seqs, counts, tokens, strict=True):
                m.num_computed_tokens += n
                assert token is not None
                drafts[i].append(token)
        return drafts

    def _sync(self, seq: Sequence) -> Sequence | None:
        """The mirror of `seq`, holding its tokens, KV past their common prefix rolled back."""
        pair = self._mirrors.get(id(seq))
        if pair is None:
            mirror = Sequence(seq.request_id, [], _GREEDY)
            self._mirrors[id(seq)] = (seq, mirror)
        else:
            mirror = pair[1]
        common = 0
        for a, b in zip(mirror.token_ids, seq.token_ids, strict=False):
            if a != b:
                break
            common += 1
        mirror.token_ids = list(seq.token_ids)
        if mirror.num_computed_tokens > common:
            mirror.num_computed_tokens = common
            self.blocks.trim(mirror)
        return mirror

    def forget(self, seq: Sequence) -> None:
        pair = self._mirrors.pop(id(seq), None)
        if pair is not None:
            self.blocks.free(pair[1])
