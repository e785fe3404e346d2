"""One step's model inputs as two broadcasts: a fixed header of sizes, then one int64 tensor.

Followers rebuild exactly the `StepInputs` rank 0 runs, plus an optional int64 `extra` payload
that a service extension attaches (the prefill worker's KV push plan).
"""

from __future__ import annotations

import torch

from pdmesh.engine.distributed import broadcast_ints, broadcast_tensor, host_to_device
from pdmesh.engine.layers.attention import AttentionMetadata
from pdmesh.engine.model_runner import StepInputs
from pdmesh.engine.parallel import ParallelGroup

# Header layout (int64): op first, then the sizes below.
HEADER_LEN = 16
_FIELDS = (
    "op",
    "tokens",
    "num_decode",
    "decode_width",
    "num_prefill",
    "prefill_width",
    "num_sampled",
    "max_decode_ctx",
    "max_prefill_q",
    "max_prefill_ctx",
    "extra",
)


def encode(
    op: int, inputs: StepInputs, extra: torch.Tensor | None
) -> tuple[list[int], torch.Tensor]:
    m = inputs.meta
    parts = [
        inputs.input_ids,
        inputs.positions,
        m.slot_mapping,
        m.decode_block_tables.flatten(),
        m.decode_context_lens,
        m.prefill_cu_seqlens,
        m.prefill_context_lens,
        m.prefill_block_tables.flatten(),
        inputs.logits_indices,
    ]
    if extra is not None:
        parts.append(extra)
    header = [
        op,
        inputs.input_ids.numel(),
        m.decode_context_lens.numel(),
        m.decode_block_tables.shape[1],
        m.prefill_context_lens.numel(),
        m.prefill_block_tables.shape[1],
        inputs.logits_indices.numel(),
        m.max_decode_context_len,
        m.max_prefill_query_len,
        m.max_prefill_context_len,
        extra.numel() if extra is not None else 0,
    ]
    # Joined where the inputs already are (the GPU): copying each part back to the host would
    # cost rank 0 a stream sync per part, every step.
    device = inputs.input_ids.device
    if extra is not None:
        parts[-1] = host_to_device(extra, device)
    flat = torch.cat([p.to(torch.int64).flatten() for p in parts])
    return header, flat


def send(op: int, inputs: StepInputs, extra: torch.Tensor | None, group: ParallelGroup) -> None:
    header, flat = encode(op, inputs, extra)
    broadcast_ints(header, HEADER_LEN, group)
    broadcast_tensor(flat, flat.numel(), torch.int64, group)


def receive_header(group: ParallelGroup) -> dict[str, int]:
    values = broadcast_ints(None, HEADER_LEN, group)
    return dict(zip(_FIELDS, values, strict=False))


def receive_step(
    h: dict[str, int], group: ParallelGroup, device: torch.device
) -> tuple[StepInputs, torch.Tensor | None]:
    t, d, dw, p, pw, s, e = (
        h["tokens"],
        h["num_decode"],
        h["decode_width"],
        h["num_prefill"],
        h["prefill_width"],
        h["num_sampled"],
        h["extra"],
    )
    sizes = [t, t, t, d * dw, d, p + 1, p, p * pw, s, e]
    flat = broadcast_tensor(None, sum(sizes), torch.int64, group).to(device)
    (ids, pos, slots, dtab, dlen, cu, plen, ptab, logits_idx, extra) = flat.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=d,
        decode_block_tables=dtab.view(d, dw).to(torch.int32),
        decode_context_lens=dlen.to(torch.int32),
        max_decode_context_len=h["max_decode_ctx"],
        prefill_cu_seqlens=cu.to(torch.int32),
        prefill_context_lens=plen.to(torch.int32),
        prefill_block_tables=ptab.view(p, pw).to(torch.int32),
        max_prefill_query_len=h["max_prefill_q"],
        max_prefill_context_len=h["max_prefill_ctx"],
    )
    inputs = StepInputs(ids, pos, meta, logits_idx, list(range(s)))
    # The plan is read on the host after every layer: one copy back now, not a sync per layer.
    return inputs, (extra.cpu() if e else None)
