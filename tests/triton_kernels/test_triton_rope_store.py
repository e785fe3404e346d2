"""The attention's prologue in one kernel (per-head norms, rotary, the KV store) against its three
kernels run in turn: without norms the query and every cache byte equal, bit for bit; with them
equal up to the order in which the squares are summed (each kernel reduces a head its own way on
a GPU), so within a rounding of the dtype, and of fp8 in the cache."""

from __future__ import annotations

import pytest
import torch

from pdmesh.kernels import rotary_and_store_kv
from pdmesh.kernels.prologue import rotary_and_store_kv_unfused

PAGE, BLOCKS = 4, 5


# (tokens, heads, KV heads, head dim, rotary dims, per-head norms, fp8 cache)
CASES = [
    (5, 4, 2, 64, 64, False, False),  # Llama: rotary and store only
    (3, 8, 2, 128, 128, True, False),  # Qwen3: q_norm and k_norm first
    (4, 6, 3, 80, 32, True, False),  # rotary on part of a head; heads not a power of two
    (6, 4, 1, 64, 64, True, True),  # an fp8 cache with scales
]


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim", "rot", "norm", "fp8"), CASES)
def test_fused_prologue_equals_its_kernels(
    tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    rot: int,
    norm: bool,
    fp8: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    g = torch.Generator().manual_seed(tokens * 7 + dim)
    # q, k, v are column slices of one [T, (H + 2 Hkv) D] projection, as the model splits them.
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 2).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (x.view(tokens, -1, dim) for x in (q, k, v))
    positions = torch.randint(0, 64, (tokens,), generator=g).to(device)
    cos_sin = torch.randn(64, rot, generator=g).to(device)
    slots = torch.randperm(PAGE * BLOCKS, generator=g)[:tokens]
    slots[1] = -1  # a padding token: its query is rotated, nothing of it stored
    slots = slots.to(device)
    weights = {}
    if norm:
        weights = {
            "q_norm": (1 + 0.2 * torch.randn(dim, generator=g)).to(device, dtype),
            "k_norm": (1 + 0.2 * torch.randn(dim, generator=g)).to(device, dtype),
            "eps": 1e-6,
        }
    scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = []
    for _ in range(2):  # one pair for each path, equal garbage where nothing is stored
        kc = torch.full((BLOCKS, PAGE, kv_heads, dim), 3.0, device=device).to(cache_dtype)
        caches.append((kc, kc.clone()))
    args = (positions, q, k, v, cos_sin)
    fused = rotary_and_store_kv(*args, *caches[0], slots, **weights, **scales)
    unfused = rotary_and_store_kv_unfused(*args, *caches[1], slots, **weights, **scales)
    if not norm:
        assert torch.equal(fused, unfused)
        for a, b in zip(caches[0], caches[1], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(fused, unfused, rtol=2 * eps, atol=2 * eps)
    step = 2**-3 if fp8 else 2 * eps  # e4m3 keeps 3 mantissa bits
    for a, b in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=step, atol=step)


def test_norm_weights_come_together(device: torch.device) -> None:
    q = torch.zeros(1, 2, 16, device=device)
    kv = torch.zeros(1, 1, 16, device=device)
    cache = torch.zeros(1, PAGE, 1, 16, device=device)
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rotary_and_store_kv(
            torch.zeros(1, dtype=torch.int64, device=device), q, kv, kv,
            torch.zeros(4, 16, device=device), cache, cache.clone(),
            torch.zeros(1, dtype=torch.int64, device=device), q_norm=torch.ones(16, device=device),
        )  # fmt: skip
