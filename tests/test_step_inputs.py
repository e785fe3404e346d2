"""Host integers to tensors for a step's inputs: the same values as `torch.tensor`, empty lists
and padding slots (-1) included, and a value that does not fit its dtype refused."""

from __future__ import annotations

import pytest
import torch

from pdmesh.engine.runner.step_inputs import HostInputs, host_tensor


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("values", [[], [-1], [0, 5, -1, 2**31 - 1], list(range(20_000))])
def test_host_tensor_equals_torch_tensor(values: list[int], dtype: torch.dtype) -> None:
    got = host_tensor(values, dtype)
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))


def test_a_value_too_large_for_int32_is_refused() -> None:
    with pytest.raises(OverflowError):
        host_tensor([2**31], torch.int32)


def test_a_decode_step_reaches_the_device_unchanged() -> None:
    tables = [[3, 4, 9], [7], [1, 2]]
    host = HostInputs(
        input_ids=[11, 12, 13],
        positions=[40, 5, 20],
        slots=[9 * 16 + 8, 7 * 16 + 5, -1],
        decode_tables=tables,
        decode_lens=[41, 6, 21],
        cu_seqlens=[0],
        prefill_lens=[],
        prefill_tables=[],
        logits_indices=[0, 1, 2],
    )
    inputs = host.to_device(torch.device("cpu"), [0, 1, 2])
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [11, 12, 13]
    assert meta.slot_mapping.tolist() == [152, 117, -1]
    assert meta.decode_block_tables.tolist() == [[3, 4, 9], [7, 0, 0], [1, 2, 0]]
    assert meta.decode_context_lens.dtype == torch.int32
    assert meta.max_decode_context_len == 41
    assert meta.prefill_block_tables.shape == (0, 1)


@pytest.mark.parametrize("num_decode", [0, 1, 2, 3, 5])
def test_every_field_of_a_mixed_step_starts_16_bytes_aligned_and_keeps_its_values(
    num_decode: int,
) -> None:
    """Triton compiles a kernel anew for each alignment of its pointers: every field starts on
    16 bytes whatever the step's mix of decode and prefill rows (fields share one copy)."""
    decode_tables = [[d + 1, d + 2] for d in range(num_decode)]
    prompts = [3, 7]  # two prefill rows of 3 and 7 tokens
    host = HostInputs(
        input_ids=list(range(num_decode + sum(prompts))),
        positions=list(range(num_decode + sum(prompts))),
        slots=list(range(100, 100 + num_decode + sum(prompts))),
        decode_tables=decode_tables,
        decode_lens=[5 + d for d in range(num_decode)],
        cu_seqlens=[0, 3, 10],
        prefill_lens=[3, 9],
        prefill_tables=[[4], [5, 6, 8]],
        logits_indices=[num_decode + 2, num_decode + 9],
    )
    inputs = host.to_device(torch.device("cpu"), list(range(num_decode + 2)))
    meta = inputs.meta
    fields = {
        "slot_mapping": meta.slot_mapping,
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "logits_indices": inputs.logits_indices,
        "decode_block_tables": meta.decode_block_tables,
        "decode_context_lens": meta.decode_context_lens,
        "prefill_cu_seqlens": meta.prefill_cu_seqlens,
        "prefill_context_lens": meta.prefill_context_lens,
        "prefill_block_tables": meta.prefill_block_tables,
    }
    misaligned = {k: v.data_ptr() % 16 for k, v in fields.items() if v.data_ptr() % 16}
    assert not misaligned, misaligned
    assert meta.prefill_cu_seqlens.tolist() == [0, 3, 10]
    assert meta.prefill_context_lens.tolist() == [3, 9]
    assert meta.prefill_block_tables.tolist() == [[4, 0, 0], [5, 6, 8]]
    assert meta.decode_context_lens.tolist() == [5 + d for d in range(num_decode)]
    assert inputs.logits_indices.tolist() == [num_decode + 2, num_decode + 9]
