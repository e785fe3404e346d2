"""`numba.njit` with its on-disk cache where one can be written.

Numba keeps what it compiles beside the module (`__pycache__`) or in the user's cache folder
(`NUMBA_CACHE_DIR` overrides both), so a new process loads a kernel instead of compiling it
again (about 2 s each). Where none is writable (a read-only install run by a user without a home)
`cache=True` fails at import; the kernels are then compiled in each process instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit


def njit_cached(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """`numba.njit` with the disk cache, and NumPy's error model: a float divided by zero is an
    inf or a NaN, as in torch, never a ZeroDivisionError. A kernel must not raise on the values
    it is given: one request's non-finite activations (a hostile or broken input) would
    otherwise fail the whole step, every request in it, where they should end only their own
    (tests/test_hostile_requests.py). Python's model, Numba's default, raised in the softmax of
    a sequence whose scores were all non-finite."""
    options = {"error_model": "numpy", **options}

    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(**options)(fn)

    return decorate
