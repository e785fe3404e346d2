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
    def decorate(fn: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(**options)(fn)

    return decorate
