"""Kernel tests: every Triton kernel against its torch reference on fresh random inputs.

Without a GPU the kernels run under Triton's interpreter (numpy, one program at a time), so the
shapes here are small. Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit
and when it runs. Here it is set while this conftest imports `pdmesh.kernels.triton`, and during
each test of this folder, and nowhere else. Triton's own @jit helpers (tl.max, tl.cdiv, ...) were
decorated when triton was first imported, which the root conftest does before this file runs (via
transformers); each test of this folder swaps in interpreted versions of them, undone after it.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _import_triton_kernels() -> None:
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("pdmesh.kernels.triton")
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _interpreted_triton_helpers() -> list[tuple[object, str, object]]:
    """(module, name, interpreted function) for each of Triton's compiled-mode @jit helpers."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swaps: list[tuple[object, str, object]] = []
    interpreted: dict[int, InterpretedFunction] = {}
    for module in (tl, tl.standard, tl.random):
        for name, value in vars(module).items():
            if isinstance(value, JITFunction):
                fn = interpreted.setdefault(id(value), InterpretedFunction(value.fn))
                swaps.append((module, name, fn))
    return swaps


class _OncePerLaunch:
    """Triton's interpreter patches triton.language (`_patch_lang`) when a kernel starts, and again
    on every call of a @jit function inside it (tl.max, rotate_halves, ...): ~0.5 ms a call
    spent listing the modules' members to set the same interpreted versions again, a third of the
    engine test's time on the Triton kernels. Within one launch a second patch of the same
    modules changes nothing, so it is skipped; the launch's own patch is undone when it ends, as
    before."""

    def __init__(self) -> None:
        from triton.runtime import interpreter

        self.interpreter = interpreter
        self.patch_lang = interpreter._patch_lang
        self.launch = interpreter.GridExecutor.__call__
        self.patched: set[frozenset[int]] | None = None  # in a launch: the module sets patched

    def patch_lang_once(self, fn: Callable[..., object]) -> object:
        import triton.language as tl

        key = frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        )
        if self.patched is not None and key in self.patched:
            return self.interpreter._LangPatchScope()  # nothing to undo
        scope = self.patch_lang(fn)
        if self.patched is not None:
            self.patched.add(key)
        return scope

    def swaps(self) -> list[tuple[object, str, object]]:
        once = self

        def launch(executor: object, *args: object, **kwargs: object) -> object:
            outer, once.patched = once.patched, set()
            try:
                return once.launch(executor, *args, **kwargs)
            finally:
                once.patched = outer

        return [
            (self.interpreter, "_patch_lang", self.patch_lang_once),
            (self.interpreter.GridExecutor, "__call__", launch),
        ]


if INTERPRET:
    _import_triton_kernels()
    _HELPER_SWAPS = _interpreted_triton_helpers() + _OncePerLaunch().swaps()


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The public wrappers route to the Triton kernels (interpreted when there is no GPU)."""
    monkeypatch.setenv("PDMESH_KERNEL_BACKEND", "triton")
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        for module, name, fn in _HELPER_SWAPS:
            monkeypatch.setattr(module, name, fn)


@pytest.fixture(autouse=True)
def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors from torch.empty / torch.empty_like start as NaN (floats) or a sentinel (ints), so
    an element a kernel forgets to write, or reads without having written, fails the test."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(-123456789)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


@pytest.fixture(
    params=[
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 on CUDA only"),
        ),
    ],
    ids=["fp32", "bf16"],
)
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def device() -> torch.device:
    return DEVICE


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out - ref‖ / ‖ref‖ in float64; NaN anywhere in `out` gives NaN (and fails a bound)."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """assert_close(out, ref): shapes equal and relative error under 1e-4 (fp32) or 1e-2."""

    def check(out: torch.Tensor, ref: torch.Tensor) -> None:
        assert out.shape == ref.shape, (out.shape, ref.shape)
        assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
        tol = 1e-4 if ref.dtype == torch.float32 else 1e-2
        err = rel_err(out, ref)
        assert err < tol, f"relative error {err:.3g} >= {tol:g}"

    return check
