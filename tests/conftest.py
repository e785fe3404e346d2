"""Shared fixtures: the embedded default model and tiny random models."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# First, before transformers: importing pdmesh takes the checkout's root off sys.path.
import pdmesh  # noqa: F401

# isort: split
import pytest
from support import make_small_default_model, make_tiny_model

# The ports meshes and services are started on: claimed machine-wide below the ephemeral range,
# so that tests run side by side (pytest -n 2) and their connections never take a port picked
# for a service that has not bound it yet (pdmesh/processes.py). Children inherit it.
os.environ.setdefault("PDMESH_PORT_RANGE", "20000-32000")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model(arch) -> folder of a saved random tiny model (made once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def default_model_folder() -> Path:
    from pdmesh.checkpoint.source import resolve_model_folder

    return resolve_model_folder(None)


@pytest.fixture(scope="session")
def default_llm(default_model_folder: Path):  # -> pdmesh.LLM, imported lazily
    """One engine on the default model shared by the tests that only read from it."""
    from pdmesh import LLM

    return LLM(kv_cache_tokens=16384)


@pytest.fixture(scope="session")
def small_model_folder(
    default_model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default model's tokenizer and layout on 4 narrow random layers (support.py)."""
    return make_small_default_model(tmp_path_factory.mktemp("small"), default_model_folder)


@pytest.fixture(scope="session")
def small_llm(small_model_folder: Path):  # -> pdmesh.LLM
    """One engine on the small model shared by the tests that only read from it."""
    from pdmesh import LLM

    return LLM(str(small_model_folder), kv_cache_tokens=16384)


# Files whose tests take a minute or more on two cores, longest first (per-file totals of
# `--durations`, 2026-11-28). They run first: under `--dist loadfile` a long file handed out last
# keeps one worker busy while the other idles (the Triton engine test, collected last, ran alone
# at the end of the suite). The Makefile passes --no-loadscope-reorder: by default xdist hands
# out files by their number of tests, most first, which put these (few, long tests) last.
LONG_FILES = (
    "test_http_gateway.py",
    "test_mesh_tp.py",
    "test_fuzz_hostile.py",
    "triton_kernels/test_triton_engine.py",
    "test_roles.py",
    "test_fuzz.py",
    "test_faults_decode.py",
    "test_eplb.py",
    "test_speculative_mesh.py",
    "test_default_model.py",
    "test_migration.py",
    "test_tensor_parallel.py",
    "test_data_parallel.py",
    "test_kvstore_workers.py",
)


def _long_first(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return next((i for i, name in enumerate(LONG_FILES) if path.endswith(name)), len(LONG_FILES))


def pytest_configure(config: pytest.Config) -> None:
    """One CPU thread for this process's torch and Numba (the in-process engines and the
    transformers references): `pytest -n 2` runs two test processes side by side on two cores,
    and a parallel region waits for whichever of its threads the other process descheduled.
    The services a test starts keep their own default, which was faster for them (measured
    both ways: docs/development.md, Tests)."""
    from pdmesh.kernels.cpu.threads import set_cpu_threads

    set_cpu_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (see LONG_FILES). Tests marked `gpu` need CUDA; on a machine
    without it they are skipped, by design."""
    import torch

    items.sort(key=_long_first)  # stable: each file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
