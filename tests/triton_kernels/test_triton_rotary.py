"""Triton rotary embedding against the reference: full and partial rotary dims, GQA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdmesh.kernels import apply_rotary
from pdmesh.kernels.rotary import apply_rotary_ref

Check = Callable[[torch.Tensor, torch.Tensor], None]
MAX_POS = 64


def _cos_sin_cache(rot_dim: int, device: torch.device) -> torch.Tensor:
    # [MAX_POS, rot_dim]: cos halves then sin halves, float32, as RotaryEmbedding builds it.
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(MAX_POS).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rot_dim"),
    [(4, 4, 64, 64), (6, 2, 128, 128), (8, 2, 128, 64)],
)
def test_apply_rotary_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rot_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    assert_close: Check,
) -> None:
    num_tokens = 11
    g = torch.Generator().manual_seed(head_dim + rot_dim)
    # q and k are views into one fused qkv projection, as the model passes them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=g).to(device, dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, _ = qkv.split(sizes, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g).to(device)
    cache = _cos_sin_cache(rot_dim, device)
    q_before, k_before = q.clone(), k.clone()

    q_out, k_out = apply_rotary(positions, q, k, cache)
    q_ref, k_ref = apply_rotary_ref(positions, q, k, cache)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
