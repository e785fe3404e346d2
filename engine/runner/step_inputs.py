"""One step's model inputs: built on the host as integers, then moved to the device.

Rank 0 builds `HostInputs` from the scheduled batch (`prepare_inputs`); tensor-parallel
followers receive the same integers (`step_codec`) and turn them into the same `StepInputs`.
Host to device goes through pinned memory without a host sync, so building a step never waits
for the one before it.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pdmesh.engine.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from pdmesh.engine.scheduling.batch import ScheduledBatch


@dataclass
class StepInputs:
    """One step's model inputs on the device. Sequences are reordered: decodes (one token)
    first."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S + P]: flat index of each sampled sequence's last token,
    # then of each prompt position whose log-probabilities were asked for (rank 0 knows them)
    sample_seq_index: list[int]  # [S]: index into batch.seqs of each sampled row
    host: HostInputs  # the integers these tensors were made from
    # [P]: (index into batch.seqs, position) of each prompt row after the sampled ones
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    # [2, C] int64: (source, copy) block ids whose KV is copied before the forward (copy on
    # write of blocks shared by a request's choices); None when there are none
    block_copies: torch.Tensor | None = None


@dataclass
class HostInputs:
    """A step's inputs as host integers (what rank 0 sends its followers)."""

    input_ids: list[int]  # [T]; empty when the ids are only on the device (see `on_device`)
    positions: list[int]  # [T]
    slots: list[int]  # [T]: KV slot of each token (block * block_size + offset)
    decode_tables: list[list[int]]  # [D][blocks]: block table of each decoding sequence
    decode_lens: list[int]  # [D]: context length after this step
    cu_seqlens: list[int]  # [P + 1]: prefill chunks' token offsets
    prefill_lens: list[int]  # [P]
    prefill_tables: list[list[int]]  # [P][blocks]
    logits_indices: list[int]  # [S]
    # [2C]: source and copy block of each copy on write, in pairs
    block_copies: list[int] = field(default_factory=list)
    # The host tier's copies, run before those (engine/kv_cache/host/pool.py): [2O] (device block,
    # host slot) pairs, then [2L] (host slot, device block) pairs
    offloads: list[int] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)
    overlap_loads: bool = False  # no sequence of the step reads the loaded blocks
    # Pipeline stages: every row is plain greedy, and the last stage samples them
    # (engine/runner/step_sampling.py)
    greedy: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def to_device(
        self,
        device: torch.device,
        sample_seq_index: list[int],
        device_ids: torch.Tensor | None = None,
    ) -> StepInputs:
        """device_ids: the step's input ids when they exist only on the device (a step
        launched before the one sampling them finished), instead of `input_ids`."""
        # Two copies to the device, one per dtype, sliced there: a pinned copy per field (ten a
        # step) cost rank 0 and every follower ~0.3 ms of host time a step (EP=2, two H200s).
        decode_flat, decode_width = padded(self.decode_tables)
        prefill_flat, prefill_width = padded(self.prefill_tables)
        ids = self.input_ids if device_ids is None else []
        slots, input_ids, positions, logits_indices, block_copies = _to_parts(
            [self.slots, ids, self.positions, self.logits_indices, self.block_copies],
            torch.int64,
            device,
        )
        decode_tables, decode_lens, cu_seqlens, prefill_lens, prefill_tables = _to_parts(
            [decode_flat, self.decode_lens, self.cu_seqlens, self.prefill_lens, prefill_flat],
            torch.int32,
            device,
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=len(self.decode_lens),
            decode_block_tables=decode_tables.view(len(self.decode_tables), decode_width),
            decode_context_lens=decode_lens,
            max_decode_context_len=max(self.decode_lens, default=0),
            prefill_cu_seqlens=cu_seqlens,
            prefill_context_lens=prefill_lens,
            prefill_block_tables=prefill_tables.view(len(self.prefill_tables), prefill_width),
            max_prefill_query_len=max(
                (b - a for a, b in itertools.pairwise(self.cu_seqlens)), default=0
            ),
            max_prefill_context_len=max(self.prefill_lens, default=0),
        )
        copies = None
        if self.block_copies:
            # [C, 2] pairs -> [2, C]: sources, then copies
            copies = block_copies.view(-1, 2).t().contiguous()
        return StepInputs(
            input_ids=device_ids if device_ids is not None else input_ids,
            positions=positions,
            meta=meta,
            logits_indices=logits_indices,
            sample_seq_index=sample_seq_index,
            host=self,
            block_copies=copies,
        )


def prepare_inputs(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    next_ids: torch.Tensor | None = None,
) -> StepInputs:
    """A scheduled batch's inputs as one flat step, decodes first (`ModelRunner.prepare`).
    next_ids ([B] on the device, decode-only batches): each sequence runs the token a step
    still on the device samples for it, at position num_tokens (the host does not know that
    token yet; see engine/scheduling/overlap.py)."""
    bs = block_size
    order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
    # input_ids, positions, slots, decode tables and lens, cu_seqlens, prefill lens and
    # tables, logits indices: filled below.
    host = HostInputs([], [], [], [], [], [0], [], [], [])
    host.block_copies = [b for pair in batch.block_copies for b in pair]
    host.offloads = [x for pair in batch.host_copies.offloads for x in pair]
    host.loads = [x for pair in batch.host_copies.loads for x in pair]
    host.overlap_loads = batch.host_copies.overlap
    sample_seq_index: list[int] = []
    prompt_rows: list[tuple[int, int, int]] = []  # (sequence, position, flat index)
    forked_from = dict(batch.forks)
    last_flat: dict[int, int] = {}  # batch index -> flat index of its sampled token
    for i in order:
        seq, n = batch.seqs[i], batch.num_new_tokens[i]
        if i in forked_from:  # a choice forked this step: its prompt's logits, resampled
            host.logits_indices.append(last_flat[forked_from[i]])
            sample_seq_index.append(i)
            continue
        start = seq.num_computed_tokens if next_ids is None else seq.num_tokens
        end = start + n
        table = seq.block_table
        drafts = seq.spec_token_ids  # speculative decoding: run after its last token
        if n == 1:  # a decode: most rows of most steps, without the ranges below
            if next_ids is None:  # one token: never a draft (those follow the last one)
                host.input_ids.append(seq.token_ids[start])
            host.positions.append(start)
            host.slots.append(table[start // bs] * bs + start % bs)
            host.decode_tables.append(table)
            host.decode_lens.append(end)
        else:
            if next_ids is None:
                ids = seq.token_ids + drafts if drafts else seq.token_ids
                host.input_ids.extend(ids[start:end])
            host.positions.extend(range(start, end))
            host.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            host.prefill_tables.append(table)
            host.prefill_lens.append(end)
            host.cu_seqlens.append(host.cu_seqlens[-1] + n)
        if end >= seq.num_tokens:
            # A row for the last token, then one per draft token it verifies.
            verified = len(drafts) if next_ids is None else 0
            last_flat[i] = len(host.positions) - 1 - verified
            host.logits_indices.extend(range(last_flat[i], len(host.positions)))
            sample_seq_index.append(i)
        if seq.params.prompt_logprobs is not None:
            # Prompt positions whose next token is a prompt token (the last one's is sampled).
            first = len(host.positions) - n
            upto = min(end, seq.num_prompt_tokens - 1)
            prompt_rows += [(i, p, first + p - start) for p in range(start, upto)]
    if next_ids is not None and (order != sorted(order) or host.num_tokens != len(order)):
        raise ValueError("next_ids is for decode-only batches (one token per sequence)")
    host.logits_indices += [flat for _, _, flat in prompt_rows]
    inputs = host.to_device(device, sample_seq_index, next_ids)
    inputs.prompt_rows = [(i, p) for i, p, _ in prompt_rows]
    return inputs


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A list of host integers as a CPU tensor (int64 or int32), through a C array: a decode step
    of 512 sequences carries about 20,000 of them, which `torch.tensor` converts 3.5x slower,
    one Python object at a time. Values that do not fit `dtype` raise OverflowError."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


_ALIGN_BYTES = 16


def _to_parts(
    parts: list[list[int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Host lists on `device` as views of one tensor; on CUDA one pinned copy for all of them,
    made without a host sync. Each view starts 16 bytes into a multiple of 16: Triton compiles a
    kernel anew for each pointer argument's alignment, and views at the offsets the step's row
    counts gave compiled prefill attention in the middle of served steps (one variant a new
    mix of decode and prefill rows, 0.5-1.5 s each, on two H200s)."""
    step = _ALIGN_BYTES // dtype.itemsize
    values = array.array(_ARRAY_CODES[dtype])
    sizes = []
    for part in parts:
        values.extend(part)  # in C: a 512-sequence decode step carries ~20,000 ints
        pad = -len(part) % step
        values.extend([0] * pad)
        sizes.append(len(part) + pad)
    flat = torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)
    if device.type != "cpu":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return [view[: len(part)] for view, part in zip(flat.split(sizes), parts, strict=True)]


def padded(rows: list[list[int]]) -> tuple[list[int], int]:
    """Rows padded with 0 to one width (at least 1), flattened; and that width."""
    width = max(max((len(r) for r in rows), default=0), 1)
    return [x for r in rows for x in (*r, *([0] * (width - len(r))))], width
