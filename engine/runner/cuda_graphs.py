"""CUDA graphs for decode steps: one graph per batch-size bucket, the LM head included.

A decode step of a small batch is hundreds of short kernels, and launching them from Python
costs more than running them. Each bucket's forward is captured once over static input buffers;
a step copies its inputs into the first rows, pads the rest (slot -1: nothing stored; context
length 1), replays the bucket's graph and reads the first rows of its logits. The decode
attention kernel takes each sequence's own context length, so one capture (made for contexts up
to max_model_len) serves any length.

A pipeline stage captures its own layers: a stage after the first reads the hidden states and
residual ([2, bs, H]) from a static buffer the runner receives them into, a stage before the
last ends at its [2, bs, H] output, which the runner sends on. The sends and receives stay out
of the graphs; both sides of a stage boundary pick the same bucket, so a whole bucket crosses
(padding rows included) straight into the receiver's buffer, without a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdmesh.engine.layers.attention import AttentionMetadata
from pdmesh.engine.parallel.pipeline import SINGLE_STAGE, PipelineStage
from pdmesh.logger import get_logger

log = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        block_size: int,
        max_batch: int,
        max_model_len: int,
        logits: bool = True,
        stage: PipelineStage = SINGLE_STAGE,
        hidden_size: int = 0,
        dtype: torch.dtype = torch.float32,
        before_forward: Callable[[AttentionMetadata], None] | None = None,
    ) -> None:
        """logits=False: the graphs end at the final hidden states and `run` applies the LM head
        eagerly (tensor parallelism: its all-gather goes through NCCL, kept out of graphs).
        stage: the pipeline stage whose layers are captured; hidden_size and dtype size the
        buffer a stage after the first receives into. before_forward: called with each
        bucket's metadata (its static buffers) before the model runs in its capture."""
        self.model = model
        self.stage = stage
        self.with_logits = logits
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        size = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        # [2 * size * H]: bucket bs's carry is the contiguous first 2 * bs * H, viewed [2, bs, H].
        self.hidden_size = hidden_size
        self._carry = None
        if not stage.is_first:
            self._carry = torch.zeros(2 * size * hidden_size, dtype=dtype, device=device)
        self.input_ids = torch.zeros(size, **i64)
        self.positions = torch.zeros(size, **i64)
        self.slot_mapping = torch.full((size,), -1, **i64)
        self.block_tables = torch.zeros(size, max_blocks, **i32)
        self.context_lens = torch.ones(size, **i32)
        empty = torch.zeros(0, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each bucket's logits (or hidden states)
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first: the others reuse its memory
                meta = AttentionMetadata(
                    slot_mapping=self.slot_mapping[:bs],
                    num_decode_tokens=bs,
                    decode_block_tables=self.block_tables[:bs],
                    decode_context_lens=self.context_lens[:bs],
                    max_decode_context_len=max_model_len,
                    prefill_cu_seqlens=torch.zeros(1, **i32),
                    prefill_context_lens=empty,
                    prefill_block_tables=torch.zeros(0, 1, **i32),
                    max_prefill_query_len=0,
                    max_prefill_context_len=0,
                )

                def forward(bs: int = bs, meta: AttentionMetadata = meta) -> torch.Tensor:
                    if before_forward is not None:
                        before_forward(meta)
                    carry = None if stage.is_first else self.carry(bs)
                    hidden = model(self.input_ids[:bs], self.positions[:bs], meta, carry)
                    if not stage.is_last:
                        return hidden  # [2, bs, H] for the next stage
                    return model.compute_logits(hidden) if logits else hidden

                forward()  # compile kernels, create library handles: outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = forward()
                pool = graph.pool()
                self.graphs[bs] = graph
        log.info("captured CUDA graphs for decode batches %s", self.buckets)

    def covers(self, num_tokens: int, num_decode: int, num_sampled: int) -> bool:
        """Whether a step is decode-only (every token samples) and fits a bucket."""
        return num_tokens == num_decode == num_sampled and 0 < num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def carry(self, bs: int) -> torch.Tensor:
        """[2, bs, H]: bucket bs's input from the previous stage (receive into it, then `run`)."""
        assert self._carry is not None, "the first stage takes token ids, not a carry"
        return self._carry[: 2 * bs * self.hidden_size].view(2, bs, self.hidden_size)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        bucket: int | None = None,
    ) -> torch.Tensor:
        """The first rows' logits ([n, V]; hidden states [n, H] with logits=False, the LM head
        then applied here), or on a stage before the last the whole bucket's [2, bs, H] output
        (a static buffer the next replay overwrites). bucket: a larger one than n's own (data-
        parallel ranks replay the same)."""
        n = input_ids.numel()
        bs = bucket if bucket is not None else self.bucket(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        width = meta.decode_block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        self.context_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        if not self.stage.is_last:
            return self.outputs[bs]
        out = self.outputs[bs][:n]
        return out if self.with_logits else self.model.compute_logits(out)

    def run_padding(self, bs: int) -> None:
        """Replay bucket `bs` with padding rows only (a data-parallel rank with nothing to run
        joins its peers' collectives): nothing is stored, the output is not read."""
        self.slot_mapping[:bs].fill_(-1)
        self.context_lens[:bs].fill_(1)
        self.graphs[bs].replay()
