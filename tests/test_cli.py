"""The `pdmesh` command as a user runs it: a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import fields
from typing import Any

import pytest
from support import hf_greedy, load_hf

from pdmesh.cli import build_parser
from pdmesh.engine.config import EngineConfig
from pdmesh.flags import engine_argv, engine_options, planner_config
from pdmesh.mesh import pair_transports, plan_mesh

PDMESH = [sys.executable, "-m", "pdmesh.cli"]
ENGINE_COMMANDS = {
    "generate": ["--offline", "--prompt", "x"],
    "up": [],
    "decode": [],
    "prefill": [],
    "worker": ["--role", "prefill"],
    "bench": ["--offline"],
}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PDMESH, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_offline_json_matches_transformers(tiny_model) -> None:
    folder = tiny_model("qwen3")
    proc = _run(
        "generate",
        "--offline",
        "--model",
        str(folder),
        "--prompt",
        "t1 t2 t3 t4 t5",
        "--max-tokens",
        "8",
        "--kv-cache-tokens",
        "512",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["prompt_token_ids"] == [1, 2, 3, 4, 5]
    # The tiny model has no EOS: the request runs to its length.
    assert result["finish_reason"] == "length"
    assert result["token_ids"] == hf_greedy(load_hf(folder), [1, 2, 3, 4, 5], 8, ignore_eos=True)
    # The text continues the prompt: the words after it, with their separating space.
    assert result["text"] == "".join(f" t{t}" for t in result["token_ids"])


def test_generate_default_model_chat_prints_text(default_model_folder) -> None:
    proc = _run(
        "generate",
        "--offline",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--kv-cache-tokens",
        "8192",
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_bad_input_is_a_clear_error_not_a_traceback(tmp_path) -> None:
    proc = _run("generate", "--offline", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run("generate", "--offline", "--prompt", "x", "--max-tokens", "0")
    assert proc.returncode == 2 and "max_tokens must be an integer >= 1" in proc.stderr


def test_up_picks_the_kv_transport_per_pair_from_gpu_placement() -> None:
    cpu = {"h:1": None, "h:2": None}
    assert pair_transports("auto", cpu, None) == ["--kv-transport", "tcp"]
    # Different GPUs: nccl. A prefill worker sharing the decode worker's GPU (GPUs ran out and
    # placement wrapped around) cannot be paired by NCCL: tcp, named for that pair only.
    gpus = {"h:1": range(0, 1), "h:2": range(1, 2), "h:3": range(2, 3)}
    assert pair_transports("auto", gpus, range(2, 3)) == [
        "--kv-transport",
        "nccl",
        "--kv-transport-for",
        "h:3=tcp",
    ]
    assert pair_transports("auto", {"h:1": range(0, 2)}, range(1, 3)) == ["--kv-transport", "tcp"]
    assert pair_transports("gloo", cpu, None) == ["--kv-transport", "gloo"]


def _not_default(name: str, default: Any) -> Any:
    """A value of EngineConfig field `name` other than its default (the flags are only parsed
    here, not validated, so any value of the right type will do)."""
    kind = typing.get_type_hints(EngineConfig)[name]
    if kind in (bool, bool | None):
        return False if default is None else not default  # unset: False, the `--no-` flag
    if kind in (int, int | None):
        return (default or 0) + 3
    if kind in (float, float | None):
        return 0.25
    if kind in (str, str | None):
        return f"x-{name}"
    raise AssertionError(f"EngineConfig.{name}: no flag type for {kind}")


def _non_defaults() -> dict[str, Any]:
    return {f.name: _not_default(f.name, f.default) for f in fields(EngineConfig)}


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
def test_every_engine_option_is_a_flag_of_every_engine_command(command: str) -> None:
    parser = build_parser()
    args = parser.parse_args([command, *ENGINE_COMMANDS[command]])
    assert engine_options(args) == {f.name: f.default for f in fields(EngineConfig)}
    values = _non_defaults()
    args = parser.parse_args([command, *ENGINE_COMMANDS[command], *engine_argv(values)])
    assert engine_options(args) == values


def test_engine_flags_keep_their_spelling() -> None:
    argv = ["prefill", "--model", "m", "--dtype", "float16", "--device", "cpu"]
    argv += ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]
    argv += ["--data-parallel-size", "1"]  # more needs nnodes=1
    argv += ["--block-size", "32", "--kv-cache-tokens", "4096", "--kv-offload-gib", "2.5"]
    argv += ["--kv-cache-memory-fraction", "0.5", "--max-num-seqs", "8"]
    argv += ["--max-num-batched-tokens", "512", "--max-model-len", "1024", "--no-prefix-caching"]
    argv += ["--enable-expert-parallel", "--seed", "7", "--enforce-eager", "--no-async-scheduling"]
    argv += ["--load-format", "dummy", "--skip-tokenizer-init", "--quantization", "fp8"]
    argv += ["--kv-cache-dtype", "fp8"]
    argv += ["--eplb-window-size", "10", "--eplb-step-interval", "20"]
    argv += ["--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", "1"]
    argv += ["--master-addr", "10.0.0.1", "--master-port", "29600"]
    options = engine_options(build_parser().parse_args(argv))
    assert options == {
        "model": "m",
        "dtype": "float16",
        "device": "cpu",
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
        "data_parallel_size": 1,
        "distributed_executor_backend": "mp",
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29600,
        "block_size": 32,
        "kv_cache_tokens": 4096,
        "kv_cache_memory_fraction": 0.5,
        "kv_offload_gib": 2.5,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 512,
        "max_model_len": 1024,
        "enable_prefix_caching": False,
        "enable_expert_parallel": True,
        "enable_eplb": False,
        "num_redundant_experts": 0,
        "eplb_window_size": 10,
        "eplb_step_interval": 20,
        "seed": 7,
        "quantization": "fp8",
        "kv_cache_dtype": "fp8",
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "async_scheduling": False,
        "speculative_config": None,
    }
    EngineConfig(**options)  # and they make a valid config
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    options = engine_options(build_parser().parse_args(["decode", "--speculative-config", spec]))
    assert EngineConfig(**options).speculative.num_speculative_tokens == 3  # type: ignore[union-attr]
    on = build_parser().parse_args(["decode", "--async-scheduling"])
    assert engine_options(on)["async_scheduling"] is True


def test_up_passes_every_engine_option_to_its_workers() -> None:
    """A field added to EngineConfig reaches `pdmesh up`'s workers with no other edit. (But one
    node: `up` refuses a multi-node launch, which is started per node; and one data-parallel
    rank a worker, test_mesh_data_parallel.py has more.)"""
    parser = build_parser()
    values = {**_non_defaults(), "nnodes": 1, "data_parallel_size": 1}
    up = parser.parse_args(["up", "--prefill", "1", "--decode", "2", *engine_argv(values)])
    specs = plan_mesh(up)
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1", "router"]
    for spec in specs[:-1]:
        assert spec.command[:3] == PDMESH
        assert engine_options(parser.parse_args(spec.command[3:])) == values, spec.name
    router = parser.parse_args(specs[-1].command[3:])
    assert (router.model, router.max_model_len) == (values["model"], values["max_model_len"])
    # A pool's own tensor-parallel size replaces --tensor-parallel-size for that pool only.
    up = parser.parse_args(["up", "--prefill-tp", "2", "--decode-tp", "3", *engine_argv(values)])
    prefill, decode, _ = plan_mesh(up)
    assert engine_options(parser.parse_args(prefill.command[3:])) == {
        **values,
        "tensor_parallel_size": 2,
    }
    assert engine_options(parser.parse_args(decode.command[3:]))["tensor_parallel_size"] == 3
    # And its own pipeline-parallel size (--prefill-pp / --decode-pp).
    up = parser.parse_args(["up", "--prefill-pp", "2", "--decode-tp", "2", *engine_argv(values)])
    prefill, decode, _ = plan_mesh(up)
    layouts = [engine_options(parser.parse_args(s.command[3:])) for s in (prefill, decode)]
    assert [(o["tensor_parallel_size"], o["pipeline_parallel_size"]) for o in layouts] == [
        (values["tensor_parallel_size"], 2),
        (2, values["pipeline_parallel_size"]),
    ]


def test_up_with_the_planner_starts_workers_of_either_role_and_a_planning_router() -> None:
    """`pdmesh up --planner`: its pools are workers that change role (`pdmesh worker --role`),
    and its router gets the planner and its knobs; a layout such a worker cannot run is refused."""
    parser = build_parser()
    knobs = ["--planner-interval-s", "0.5", "--slo-ttft-ms", "300", "--slo-itl-ms", "80"]
    knobs += ["--planner-sustain", "2", "--planner-dwell-s", "5", "--load-aware-disagg"]
    up = parser.parse_args(["up", "--planner", "--prefill", "1", "--decode", "2", *knobs])
    specs = plan_mesh(up)
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "decode-1", "router"]
    workers = [parser.parse_args(s.command[3:]) for s in specs[:-1]]
    assert [(w.command, w.role) for w in workers] == [
        ("worker", "prefill"),
        ("worker", "decode"),
        ("worker", "decode"),
    ]
    router = parser.parse_args(specs[-1].command[3:])
    assert (router.prefill, router.decode) == (
        specs[0].address,
        f"{specs[1].address},{specs[2].address}",
    )
    config = planner_config(router)
    assert config is not None and router.load_aware_disagg
    assert (config.interval_s, config.slo_ttft_s, config.slo_itl_s) == (0.5, 0.3, 0.08)
    assert (config.sustain, config.dwell_s) == (2, 5.0)
    plain = parser.parse_args(plan_mesh(parser.parse_args(["up"]))[-1].command[3:])
    assert planner_config(plain) is None and not plain.load_aware_disagg
    # Without the planner, load-aware disaggregation still gets its TTFT target.
    aware = parser.parse_args(["up", "--load-aware-disagg", "--slo-ttft-ms", "700"])
    router = parser.parse_args(plan_mesh(aware)[-1].command[3:])
    assert router.load_aware_disagg and router.slo_ttft_ms == 700
    assert router.slo_itl_p99_ms is None
    # ... and its inter-token target, where one is set, with or without the planner.
    for planner in ([], ["--planner"]):
        itl = parser.parse_args(["up", *planner, "--load-aware-disagg", "--slo-itl-p99-ms", "25"])
        assert parser.parse_args(plan_mesh(itl)[-1].command[3:]).slo_itl_p99_ms == 25
    with pytest.raises(ValueError, match="run one rank"):
        plan_mesh(parser.parse_args(["up", "--planner", "--decode-tp", "2"]))
