"""Which implementation a kernel wrapper runs: the torch reference or a Triton kernel.

Every wrapper in this package calls `pick(name, tensor)`; a Triton implementation registers
itself with `register_triton(name)`. `PDMESH_KERNEL_BACKEND=torch` forces the references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdmesh import envs

_TRITON: dict[str, Callable[..., Any]] = {}


def register_triton(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _TRITON[name] = fn
        return fn

    return deco


def pick(name: str, like: torch.Tensor, reference: Callable[..., Any]) -> Callable[..., Any]:
    """The implementation of kernel `name` for tensors like `like`."""
    backend = envs.kernel_backend()
    if backend == "torch":
        return reference
    if backend == "triton" or like.is_cuda:
        fn = _TRITON.get(name)
        if fn is not None:
            return fn
        if backend == "triton":
            raise RuntimeError(f"no Triton implementation of kernel {name!r} is registered")
    return reference
