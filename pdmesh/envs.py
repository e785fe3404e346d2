"""Every environment variable pdmesh reads, in one place, under the PDMESH_ prefix."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models (GGUF -> safetensors) are kept. PDMESH_CACHE_DIR."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdmesh"
    return Path(os.environ.get("PDMESH_CACHE_DIR", default))


def log_level() -> str:
    """PDMESH_LOG_LEVEL: DEBUG, INFO (default), WARNING, ERROR."""
    return os.environ.get("PDMESH_LOG_LEVEL", "INFO").upper()


def kernel_backend() -> str:
    """PDMESH_KERNEL_BACKEND: 'auto' (Triton on CUDA, torch elsewhere), 'torch' or 'triton'."""
    value = os.environ.get("PDMESH_KERNEL_BACKEND", "auto").lower()
    if value not in ("auto", "torch", "triton"):
        raise ValueError(f"PDMESH_KERNEL_BACKEND must be auto, torch or triton, got {value!r}")
    return value


def num_threads() -> int | None:
    """PDMESH_NUM_THREADS: torch intra-op threads on CPU (default: torch's own choice)."""
    value = os.environ.get("PDMESH_NUM_THREADS")
    return int(value) if value else None


def flag_env(dest: str) -> str | None:
    """The PDMESH_<DEST> variable that stands for a command-line flag, if set."""
    return os.environ.get(f"PDMESH_{dest.upper()}")
