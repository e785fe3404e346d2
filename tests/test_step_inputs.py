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
