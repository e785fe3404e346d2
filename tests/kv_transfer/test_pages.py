"""Block gathers and scatters moved as 8-byte words equal torch's index_select / index_copy_."""

from __future__ import annotations

import pytest
import torch

from pdmesh.kv_transfer.pages import _words, gather_blocks, scatter_blocks

CACHE = torch.randn(4, 2, 10, 16, 8, 16).to(torch.bfloat16)  # [L, 2, blocks, bs, heads, dim]
IDS = torch.tensor([3, 1, 7, 9])


@pytest.mark.parametrize(
    ("view", "dim", "as_words"),
    [
        (CACHE, 2, True),  # every layer
        (CACHE[1], 1, True),  # one layer's pages
        (CACHE[1:3], 2, True),  # a run of layers
        (CACHE[..., 2:5, :], 2, False),  # a head slice splits each block: element by element
        (CACHE.view(torch.uint8)[..., 2:34].view(torch.bfloat16), 2, False),  # not 8-aligned
    ],
)
def test_gather_equals_index_select(view: torch.Tensor, dim: int, as_words: bool) -> None:
    assert (_words(view, dim) is not None) == as_words
    got = gather_blocks(view, dim, IDS)
    assert got.is_contiguous() and torch.equal(got, view.index_select(dim, IDS))


@pytest.mark.parametrize("heads", [slice(None), slice(2, 5)])
def test_scatter_equals_index_copy(heads: slice) -> None:
    src = torch.randn(4, 2, 4, 16, 8, 16).to(torch.bfloat16)[..., heads, :]
    ours, torchs = torch.zeros_like(CACHE), torch.zeros_like(CACHE)
    scatter_blocks(ours[..., heads, :], 2, IDS, src)
    torchs[..., heads, :].index_copy_(2, IDS, src)
    assert torch.equal(ours, torchs) and ours.abs().sum() > 0
