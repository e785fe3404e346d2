"""The layouts benchmark's dry run on the CPU (`gpu_layouts --tiny`): a two-rank EP engine's
decode steps profiled on both ranks, with the host spans that time each follower against rank 0
(engine/executor/profiling.py `span`, bench/step_timeline.py `follower_lag`)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_follower_lag_comes_from_both_ranks_host_spans(tmp_path) -> None:
    argv = ["--out", str(tmp_path), "--tiny", "--only", "moe", "--layouts", "ep2"]
    subprocess.run(
        [sys.executable, "-m", "pdmesh.bench.gpu_layouts", *argv, "--timelines", "ep2"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    layout = json.loads((tmp_path / "layouts.json").read_text())["moe"]["ep2"]
    lag = layout["timeline_b1"]["follower_lag_us"]
    # Rank 0 sent every profiled step and waited for its tokens; the follower waited for,
    # received and ran each (CPU: no CUDA graphs, so no graph launches to pair).
    assert lag["rank0"]["driver.send_step"] > 0 and lag["rank0"]["engine.collect"] > 0
    follower = lag["rank1"]
    assert all(follower[k] > 0 for k in ("follower.receive_step", "follower.run_step"))
    assert follower["graph_after_rank0_graph"] is None
    assert layout["b1_ctx64_ms_per_token"] > 0
