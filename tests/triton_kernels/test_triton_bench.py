"""The kernel benchmark script runs end to end (tiny shapes; timings meaningless off a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from pdmesh.bench.kernels import main

KERNELS = {
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "fused_add_rms_norm",
    "apply_rotary",
    "silu_and_mul",
    "linear",
    "silu_and_mul_linear",
    "moe_route",
    "moe_experts",
}


def test_kernel_benchmark_checks_every_kernel_and_writes_json(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path), "--smoke"]) == 0
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert {r["kernel"] for r in report["results"]} == KERNELS
    assert all(r["ok"] and r["triton_us"] > 0 for r in report["results"])
    assert report["ceilings"]["copy_bytes_per_s"] > 0
