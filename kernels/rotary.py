"""Rotary position embedding, rotate-half ("neox") style, from a cos/sin cache."""

from __future__ import annotations

import torch

from pdmesh.kernels.backend import pick


def apply_rotary(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim]: cos halves then sin halves, float32
) -> tuple[torch.Tensor, torch.Tensor]:
    return pick("apply_rotary", query, apply_rotary_ref)(positions, query, key, cos_sin_cache)


def apply_rotary_ref(positions, query, key, cos_sin_cache):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, rot_dim/2] each
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    # Same arithmetic as Hugging Face: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),
    # with cos/sin rounded to x's dtype first.
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out
