"""One step's model inputs for the follower ranks: a fixed header of sizes, then one int64
payload, both over the host group; and the input ids over the model's group when they exist only
on the device (a step launched before the step sampling them finished: async scheduling).

Every message to the followers starts with one fixed-size message on the step channel (shared
memory on one machine, else a gloo broadcast: engine/parallel/step_channel.py): the header and
the first INLINE ints of the payload, so a step of a few sequences is one message; a longer
payload's rest follows over the host group.

Followers rebuild exactly the `StepInputs` rank 0 runs (its copies on write of KV blocks and its
host-tier copies included), plus an optional int64 `extra` payload: the step's plan from the KV
connector (`KVConnector.plan_step`, e.g. the prefill worker's pushes).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from pdmesh.engine.parallel.comm import broadcast_device, broadcast_host
from pdmesh.engine.parallel.group import ParallelGroup
from pdmesh.engine.parallel.step_channel import StepChannel
from pdmesh.engine.runner.step_inputs import HostInputs, StepInputs, host_tensor, padded

# Header layout (int64): op first, then the sizes below.
HEADER_LEN = 16
INLINE = 1024  # payload ints carried by the first broadcast (a decode step of ~50 sequences)
FIRST_LEN = HEADER_LEN + INLINE
_SIZES = (
    "tokens",
    "num_decode",
    "decode_width",
    "num_prefill",
    "prefill_width",
    "num_sampled",
    "num_copies",
    "num_offloads",
    "num_loads",
)
_FIELDS = ("op", *_SIZES, "extra", "ids_on_device", "overlap_loads", "greedy")


def encode(op: int, host: HostInputs, extra: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """(header, payload): the payload holds every host integer of the step, in field order."""
    ids_on_device = len(host.input_ids) != host.num_tokens
    decode_flat, decode_width = padded(host.decode_tables)
    prefill_flat, prefill_width = padded(host.prefill_tables)
    header = [
        op,
        host.num_tokens,
        len(host.decode_lens),
        decode_width,
        len(host.prefill_lens),
        prefill_width,
        len(host.logits_indices),
        len(host.block_copies) // 2,
        len(host.offloads) // 2,
        len(host.loads) // 2,
        extra.numel() if extra is not None else 0,
        int(ids_on_device),
        int(host.overlap_loads),
        int(host.greedy),
    ]
    values = [
        *host.input_ids,
        *host.positions,
        *host.slots,
        *decode_flat,
        *host.decode_lens,
        *host.cu_seqlens,
        *host.prefill_lens,
        *prefill_flat,
        *host.logits_indices,
        *host.block_copies,
        *host.offloads,
        *host.loads,
    ]
    payload = host_tensor(values, torch.int64)
    if extra is not None:
        payload = torch.cat([payload, extra.to(torch.int64).flatten()])
    return header, payload


# ids_on_device: 0 the ids are in the payload; 1 they follow over the model's group; 2 they stay
# on rank 0's device (no follower embeds tokens: pipeline stages of one rank).
IDS_FOLLOW, IDS_STAY = 1, 2


def send(
    op: int,
    inputs: StepInputs,
    extra: torch.Tensor | None,
    group: ParallelGroup,
    channel: StepChannel,
    ids_travel: bool = True,
) -> None:
    """ids_travel=False: input ids that exist only on rank 0's device are not sent (the
    followers then run zeros in their place)."""
    header, payload = encode(op, inputs.host, extra)
    ids = _FIELDS.index("ids_on_device")
    if header[ids] and not ids_travel:
        header[ids] = IDS_STAY
    _send_first(header, payload, channel)
    if payload.numel() > INLINE:
        rest = payload[INLINE:]
        broadcast_host(rest, rest.numel(), torch.int64, group)
    if header[ids] == IDS_FOLLOW:
        # the ids: queued on the device after the step that samples them
        broadcast_device(inputs.input_ids, inputs.host.num_tokens, torch.int64, group)


def send_op(op: int, channel: StepChannel) -> None:
    """A message of `op` alone (control, stop): the first message, no payload."""
    _send_first([op], torch.empty(0, dtype=torch.int64), channel)


def _send_first(header: list[int], payload: torch.Tensor, channel: StepChannel) -> None:
    first = torch.zeros(FIRST_LEN, dtype=torch.int64)
    first[: len(header)] = torch.tensor(header, dtype=torch.int64)
    inline = payload[:INLINE]
    first[HEADER_LEN : HEADER_LEN + inline.numel()] = inline
    channel.broadcast(first)


class Header(NamedTuple):
    fields: dict[str, int]  # "op", then the sizes (`_FIELDS`)
    inline: torch.Tensor  # [INLINE] int64: the payload's first ints


def receive_header(channel: StepChannel) -> Header:
    first = channel.broadcast(None)
    fields = dict(zip(_FIELDS, first[:HEADER_LEN].tolist(), strict=False))
    return Header(fields, first[HEADER_LEN:])


def receive_step(
    header: Header, group: ParallelGroup, device: torch.device
) -> tuple[StepInputs, torch.Tensor | None]:
    h = header.fields
    t, d, dw, p, pw, s, c, o, ld = (h[name] for name in _SIZES)
    e = h["extra"]
    on_device = bool(h["ids_on_device"])
    sizes = [0 if on_device else t, t, t, d * dw, d, p + 1, p, p * pw, s, 2 * c, 2 * o, 2 * ld]
    total = sum(sizes) + e
    payload = header.inline[: min(total, INLINE)]
    if total > INLINE:
        rest = broadcast_host(None, total - INLINE, torch.int64, group)
        payload = torch.cat([payload, rest])
    values = payload[: sum(sizes)].tolist()
    ends = list(itertools.accumulate(sizes))
    parts = [values[end - n : end] for n, end in zip(sizes, ends, strict=True)]
    ids, pos, slots, dtab, dlen, cu, plen, ptab, logits_idx, copies, offloads, loads = parts
    host = HostInputs(
        input_ids=ids,
        positions=pos,
        slots=slots,
        decode_tables=[dtab[i * dw : (i + 1) * dw] for i in range(d)],
        decode_lens=dlen,
        cu_seqlens=cu,
        prefill_lens=plen,
        prefill_tables=[ptab[i * pw : (i + 1) * pw] for i in range(p)],
        logits_indices=logits_idx,
        block_copies=copies,
        offloads=offloads,
        loads=loads,
        overlap_loads=bool(h["overlap_loads"]),
        greedy=bool(h["greedy"]),
    )
    device_ids = None
    if h["ids_on_device"] == IDS_FOLLOW:
        device_ids = broadcast_device(None, t, torch.int64, group)
    elif h["ids_on_device"] == IDS_STAY:  # read by no layer of this rank
        device_ids = torch.zeros(t, dtype=torch.int64, device=device)
    inputs = host.to_device(device, list(range(s)), device_ids)
    return inputs, (payload[sum(sizes) :] if e else None)
