"""The L2 read-ahead kernel reads every word of a tensor once and leaves it unchanged."""

from __future__ import annotations

from functools import reduce

import pytest
import torch

from pdmesh.kernels import read_into_l2
from pdmesh.kernels.prefetch import read_into_l2_ref
from pdmesh.kernels.triton.l2_read import BLOCK


def _xor_all(words: torch.Tensor) -> int:
    return reduce(lambda a, b: a ^ b, words.tolist(), 0)


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((7, 12), torch.bfloat16),  # a partial block
        ((3 * BLOCK + 5,), torch.float32),  # programs loop, the last one short
        ((64, 2 * BLOCK), torch.float8_e4m3fn),  # an fp8 weight: four weights a word
    ],
)
def test_read_into_l2_reads_every_word(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    g = torch.Generator().manual_seed(1)
    t = torch.randn(*shape, generator=g).to(dtype).to(device)
    before = t.clone()
    sink = read_into_l2(t)
    words = t.reshape(-1).view(torch.int32).cpu()
    assert _xor_all(sink.cpu()) == _xor_all(words) == _xor_all(read_into_l2_ref(t).cpu())
    assert torch.equal(t.view(torch.int8), before.view(torch.int8))  # read, never written


def test_a_changed_word_changes_what_is_read(device: torch.device) -> None:
    t = torch.arange(4 * BLOCK + 3, dtype=torch.int32).to(device)
    first = _xor_all(read_into_l2(t).cpu())
    t[-1] += 1  # the last word of the last program's short tile
    assert _xor_all(read_into_l2(t).cpu()) != first
