"""Which implementation a kernel wrapper runs: the torch reference, a Triton kernel, or a CPU one.

Every wrapper in this package calls `pick(name, tensor)`; a Triton implementation registers
itself with `register_triton(name)`, a CPU one with `register_cpu(name)`. The Triton
implementations (`pdmesh.kernels.triton`) are imported the first time one could be used (a CUDA
tensor, or `PDMESH_KERNEL_BACKEND=triton`), so CPU-only processes never import Triton; the CPU
ones (`pdmesh.kernels.cpu`) the first time a kernel runs on a CPU tensor. A kernel without an
implementation for the device runs its reference. `PDMESH_KERNEL_BACKEND=torch` forces the
references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pdmesh import envs
from pdmesh.logger import get_logger

_TRITON: dict[str, Callable[..., Any]] = {}
_CPU: dict[str, Callable[..., Any]] = {}
# Kernels run as their references whatever the backend (run_reference).
_REFERENCE_ONLY: set[str] = set()
# Whether importing pdmesh.kernels.triton has been tried (once per process, hit or miss).
_TRITON_IMPORT_TRIED = False
_CPU_IMPORTED = False


def _registrar(
    table: dict[str, Callable[..., Any]],
) -> Callable[[str], Callable[[Callable[..., Any]], Callable[..., Any]]]:
    def register(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            table[name] = fn
            return fn

        return deco

    return register


register_triton = _registrar(_TRITON)
register_cpu = _registrar(_CPU)


def pick(name: str, like: torch.Tensor, reference: Callable[..., Any]) -> Callable[..., Any]:
    """The implementation of kernel `name` for tensors like `like`."""
    backend = envs.kernel_backend()
    if backend == "torch" or name in _REFERENCE_ONLY:
        return reference
    if backend == "triton" or like.is_cuda:
        if not _TRITON_IMPORT_TRIED:
            _import_triton_kernels()
        fn = _TRITON.get(name)
        if fn is not None:
            return fn
        if backend == "triton":
            raise RuntimeError(
                f"PDMESH_KERNEL_BACKEND=triton, but no Triton implementation of kernel {name!r} "
                "is registered (is the triton package installed?)"
            )
        return reference
    if like.device.type == "cpu":
        if not _CPU_IMPORTED:
            _import_cpu_kernels()
        return _CPU.get(name, reference)
    return reference


def _import_cpu_kernels() -> None:
    global _CPU_IMPORTED
    _CPU_IMPORTED = True
    import pdmesh.kernels.cpu  # noqa: F401  (registers the CPU kernels)


def _import_triton_kernels() -> None:
    global _TRITON_IMPORT_TRIED
    _TRITON_IMPORT_TRIED = True
    try:
        import pdmesh.kernels.triton  # noqa: F401  (registers the Triton kernels)
    except ImportError as exc:
        get_logger(__name__).warning("Triton kernels unavailable, using torch references: %s", exc)


def run_reference(name: str) -> None:
    """From now on in this process, kernel `name` runs its reference on every device and
    backend (for a fused kernel: the kernels it replaced). Benchmarks compare a kernel with what
    it replaced this way (bench/without_kernel.py); nothing in the product calls it."""
    if not _TRITON_IMPORT_TRIED:
        _import_triton_kernels()
    if not _CPU_IMPORTED:
        _import_cpu_kernels()
    if name not in _TRITON and name not in _CPU:
        raise ValueError(f"no kernel {name!r} is registered")
    _REFERENCE_ONLY.add(name)


@contextmanager
def cpu_kernels_wrapped(
    wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]], names: Iterable[str]
) -> Iterator[None]:
    """While the block runs, the CPU kernel registered as each of `names` is `wrap(name,
    kernel)`, and is put back afterwards. Benchmarks time a step's kernels this way
    (bench/decode_step_cpu.py); nothing in the product calls it."""
    if not _CPU_IMPORTED:
        _import_cpu_kernels()
    missing = [name for name in names if name not in _CPU]
    if missing:
        raise ValueError(f"no CPU kernel registered as {', '.join(map(repr, missing))}")
    kernels = {name: _CPU[name] for name in names}
    for name, fn in kernels.items():
        _CPU[name] = wrap(name, fn)
    try:
        yield
    finally:
        _CPU.update(kernels)
