"""Unset `max_num_seqs` / `max_num_batched_tokens` take vLLM's defaults for the device and the
use (offline through LLM, or a served worker); values given are kept."""

from __future__ import annotations

import pytest

from pdmesh import LLM
from pdmesh.engine.config import EngineConfig, batch_defaults

GiB = 2**30


@pytest.mark.parametrize(
    ("device", "memory", "name", "offline", "want"),
    [
        ("cpu", 0, "", True, (256, 2048)),
        ("cpu", 0, "", False, (256, 2048)),
        ("cuda", 80 * GiB, "NVIDIA H100 80GB HBM3", True, (1024, 16384)),
        ("cuda", 80 * GiB, "NVIDIA H100 80GB HBM3", False, (1024, 8192)),
        ("cuda", 141 * GiB, "NVIDIA H200", False, (1024, 8192)),
        ("cuda", 80 * GiB, "NVIDIA A100-SXM4-80GB", True, (256, 8192)),
        ("cuda", 24 * GiB, "NVIDIA L4", False, (256, 2048)),
    ],
)
def test_batch_defaults_follow_the_device_and_the_use(
    device: str, memory: int, name: str, offline: bool, want: tuple[int, int]
) -> None:
    assert batch_defaults(device, memory, name, offline) == want


def test_values_given_are_kept_and_unset_ones_filled() -> None:
    config = EngineConfig(device="cpu", max_num_seqs=8)
    filled = config.with_batch_defaults(offline=True)
    assert (filled.max_num_seqs, filled.max_num_batched_tokens) == (8, 2048)
    given = EngineConfig(device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    assert given.with_batch_defaults(offline=False) is given


def test_an_engine_schedules_with_the_resolved_budget(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu", kv_cache_tokens=1024)
    scheduler = llm.engine.scheduler
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (256, 2048)
    assert llm.engine.config.max_num_batched_tokens == 2048
