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
    """PDMESH_KERNEL_BACKEND: 'auto' (Triton on CUDA, the CPU kernels on CPUs, each kernel's
    torch reference where neither has one), 'torch' (the references) or 'triton'."""
    value = os.environ.get("PDMESH_KERNEL_BACKEND", "auto").lower()
    if value not in ("auto", "torch", "triton"):
        raise ValueError(f"PDMESH_KERNEL_BACKEND must be auto, torch or triton, got {value!r}")
    return value


def gemv_max_rows() -> int:
    """PDMESH_GEMV_MAX_ROWS: projections of at most this many rows (tokens) run on the GEMV
    kernel on CUDA (default 1, a batch-1 decode; at most 4); 0 leaves all to the matmul library."""
    value = int(os.environ.get("PDMESH_GEMV_MAX_ROWS", "1"))
    if not 0 <= value <= 4:
        raise ValueError(f"PDMESH_GEMV_MAX_ROWS must be in [0, 4], got {value}")
    return value


def pdl() -> bool:
    """PDMESH_PDL: programmatic dependent launch of the decode path's Triton kernels (GEMVs,
    RMSNorm, rotary, KV store, decode attention, MoE routing and expert GEMVs) on GPUs that have
    it (compute capability 9.0 and newer): each is launched while the kernel before it finishes,
    reads what does not depend on it (its weights) and then waits for it. 1 (default): on where
    the GPU has it; 0: off (measured on an H100: docs/gpu.md)."""
    value = os.environ.get("PDMESH_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDMESH_PDL must be 0 or 1, got {value!r}")
    return value == "1"


def keep_freed_memory() -> bool:
    """PDMESH_KEEP_FREED_MEMORY: whether CPU workers keep what malloc frees for their next step
    (1, default; pdmesh/processes.py) or let glibc hand it back to the OS (0)."""
    value = os.environ.get("PDMESH_KEEP_FREED_MEMORY", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDMESH_KEEP_FREED_MEMORY must be 0 or 1, got {value!r}")
    return value == "1"


def warm_start() -> bool:
    """PDMESH_WARM_START: whether workers, follower ranks and data-parallel replicas start as
    forks of a process that has imported torch already (1, default; pdmesh/warm_start.py) or
    each in a new interpreter (0)."""
    value = os.environ.get("PDMESH_WARM_START", "1")
    if value not in ("0", "1"):
        raise ValueError(f"PDMESH_WARM_START must be 0 or 1, got {value!r}")
    return value == "1"


def all_reduce() -> str:
    """PDMESH_ALL_REDUCE: how tensor-parallel ranks sum decode steps' small tensors on GPUs.
    'auto' (default): a one-shot all-reduce over symmetric memory that copies its input in
    itself; 'staged': the same after a separate copy into the shared buffer; 'nccl': NCCL only,
    which keeps TP > 1 decode steps out of CUDA graphs."""
    value = os.environ.get("PDMESH_ALL_REDUCE", "auto").lower()
    if value not in ("auto", "staged", "nccl"):
        raise ValueError(f"PDMESH_ALL_REDUCE must be auto, staged or nccl, got {value!r}")
    return value


def two_shot_bytes() -> int:
    """PDMESH_TWO_SHOT_BYTES: with PDMESH_ALL_REDUCE=auto, all-reduces of at least this many
    bytes take the two-shot kernel instead of the one-shot (default 1 MiB, measured on two
    H100s: engine/parallel/symm_all_reduce.py)."""
    value = int(os.environ.get("PDMESH_TWO_SHOT_BYTES", str(1 << 20)))
    if value < 0:
        raise ValueError(f"PDMESH_TWO_SHOT_BYTES must be 0 or more, got {value}")
    return value


def pp_batches(pipeline_parallel_size: int) -> int:
    """PDMESH_PP_BATCHES: with pipeline stages, how many batches of other sequences are in
    flight at once (default: one per stage, as vLLM's virtual engines)."""
    value = int(os.environ.get("PDMESH_PP_BATCHES", str(pipeline_parallel_size)))
    if value < 1:
        raise ValueError(f"PDMESH_PP_BATCHES must be 1 or more, got {value}")
    return value


def dp_agreement() -> str:
    """PDMESH_DP_AGREEMENT: how data-parallel ranks under data-parallel attention agree on each
    step's size. 'auto' (default): through shared memory where every rank is on this x86-64
    machine, else a gloo all-reduce; 'gloo': the gloo all-reduce always."""
    value = os.environ.get("PDMESH_DP_AGREEMENT", "auto").lower()
    if value not in ("auto", "gloo"):
        raise ValueError(f"PDMESH_DP_AGREEMENT must be auto or gloo, got {value!r}")
    return value


def step_channel() -> str:
    """PDMESH_STEP_CHANNEL: how rank 0 sends each step to its tensor- and pipeline-parallel
    followers. 'auto' (default): through shared memory on GPUs where every rank is on this
    x86-64 machine, else gloo; 'shm': shared memory on CPUs too; 'gloo': gloo always."""
    value = os.environ.get("PDMESH_STEP_CHANNEL", "auto").lower()
    if value not in ("auto", "shm", "gloo"):
        raise ValueError(f"PDMESH_STEP_CHANNEL must be auto, shm or gloo, got {value!r}")
    return value


def num_threads() -> int | None:
    """PDMESH_NUM_THREADS: torch intra-op threads on CPU (default: torch's own choice)."""
    value = os.environ.get("PDMESH_NUM_THREADS")
    return int(value) if value else None


def flag_env(dest: str) -> str | None:
    """The PDMESH_<DEST> variable that stands for a command-line flag, if set."""
    return os.environ.get(f"PDMESH_{dest.upper()}")


def with_flag_env(dest: str, value: str) -> dict[str, str]:
    """This process's environment plus PDMESH_<DEST>=value: how `pdmesh up` hands a child a
    secret (API keys) without putting it on a command line that `ps` shows."""
    return {**os.environ, f"PDMESH_{dest.upper()}": value}


def tp_spec() -> str:
    """PDMESH_TP_SPEC: the JSON a tensor-parallel follower rank is started with (set by rank 0)."""
    value = os.environ.get("PDMESH_TP_SPEC")
    if not value:
        raise RuntimeError("PDMESH_TP_SPEC is not set: followers are started by their rank 0")
    return value


def dp_spec() -> str:
    """PDMESH_DP_SPEC: the JSON a data-parallel replica is started with (set by the front)."""
    value = os.environ.get("PDMESH_DP_SPEC")
    if not value:
        raise RuntimeError("PDMESH_DP_SPEC is not set: replicas are started by their front end")
    return value


def pp_layer_partition() -> str | None:
    """PDMESH_PP_LAYER_PARTITION: decoder layers per pipeline stage, e.g. "16,16" (default: an
    even split)."""
    return os.environ.get("PDMESH_PP_LAYER_PARTITION") or None


# -- OpenTelemetry: the standard OTEL_* variables, read here so pdmesh decides whether to trace --
def otel_traces_exporters() -> tuple[str, ...]:
    """The span exporters the standard variables ask for; () means tracing is off.

    OTEL_SDK_DISABLED=true turns tracing off; OTEL_TRACES_EXPORTER names exporters ('otlp',
    'console', 'none'); without it, an OTLP endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) means 'otlp'. Nothing set: off.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        chosen = tuple(n.strip() for n in names.split(",") if n.strip() and n.strip() != "none")
    elif os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    ):
        chosen = ("otlp",)
    else:
        chosen = ()
    for name in chosen:
        if name not in ("otlp", "console"):
            raise ValueError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {name!r}")
    return chosen


def otel_otlp_traces_protocol() -> str:
    """OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL: 'grpc' (default, the
    Python SDK's) or 'http/protobuf'."""
    value = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if value not in ("grpc", "http/protobuf"):
        raise ValueError(f"the OTLP protocol must be grpc or http/protobuf, got {value!r}")
    return value


def port_range() -> tuple[int, int] | None:
    """PDMESH_PORT_RANGE=LO-HI: the ports `pdmesh up` (and its tests) pick for its services come
    from [LO, HI), each claimed machine-wide (pdmesh/processes.py), instead of any free port.
    Below the kernel's ephemeral range (32768 on Linux) no outgoing connection can take a port
    between its pick and its bind. Unset: any free port the kernel names."""
    value = os.environ.get("PDMESH_PORT_RANGE")
    if not value:
        return None
    lo, sep, hi = value.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit() and 1024 <= int(lo) < int(hi) <= 65536):
        raise ValueError(f"PDMESH_PORT_RANGE must be LO-HI within 1024-65536, got {value!r}")
    return int(lo), int(hi)
