"""A static multi-node launch without Ray (torchrun's flags): two `pdmesh decode` processes on
this machine acting as nodes 0 and 1 of `--nnodes 2`, node 0 serving gRPC behind a router; a
rank killed on node 1 takes the worker out; layouts that do not divide over the nodes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from mesh_support import greedy_tokens
from service_support import Service, wait_workers
from support import hf_greedy, load_hf, random_prompts, running

from pdmesh import LLM, SamplingParams
from pdmesh.cli import build_parser
from pdmesh.cli import main as pdmesh_main
from pdmesh.engine.config import EngineConfig
from pdmesh.mesh import plan_mesh
from pdmesh.processes import free_port


def test_two_nodes_serve_and_a_dead_rank_takes_the_worker_out(tiny_model, tmp_path) -> None:
    folder = str(tiny_model("llama"))
    layout = ["--model", folder, "--kv-cache-tokens", "1024", "--pipeline-parallel-size", "2"]
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    node1 = Service("decode", [*layout, *nodes, "--node-rank", "1"], tmp_path / "node1.log")
    node0 = Service("decode", ["--port", str(free_port()), *layout, *nodes], tmp_path / "node0.log")
    argv = ["--port", str(free_port()), "--http-port", "0", "--decode", node0.address]
    router = Service("router", [*argv, "--model", folder], tmp_path / "router.log")
    services = [node1.start(), node0.start(), router.start()]
    try:
        node0.wait_serving()
        wait_workers(router.address, 0, 1)
        prompts = random_prompts([9, 33], seed=4)
        got = asyncio.run(greedy_tokens(router.address, prompts, 10))
        hf = load_hf(Path(folder))
        assert got == [hf_greedy(hf, p, 10, ignore_eos=True) for p in prompts]
        assert node0.stats().pipeline_parallel_size == 2

        assert node1.proc is not None and node0.proc is not None
        # node 1 runs rank 1, stage 1
        (rank1,) = running("pdmesh.engine.executor.follower", node1.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        while node0.serving():
            assert time.monotonic() - killed < 1.0, "node 0 kept serving without its stage 1"
            time.sleep(0.05)
        assert node1.proc.wait(30) == 1  # node 1 reported its rank's death and exited
        node0.proc.wait(30)  # the worker exits, for `pdmesh up` or Kubernetes to restart
        assert "rank 1 on node 1 exited with code -9" in node0.log.read_text()
    finally:
        for s in services:
            s.stop()


def test_tensor_parallel_over_two_nodes_offline(tiny_model, tmp_path) -> None:
    """TP=2 with one rank per node: node 0 is an offline `LLM` here (engine flags are `LLM`
    options too), node 1 a `pdmesh decode --node-rank 1` process, which exits cleanly once the
    LLM is closed."""
    folder = str(tiny_model("llama"))
    port = free_port()
    nodes = dict(nnodes=2, master_addr="127.0.0.1", master_port=port, tensor_parallel_size=2)
    argv = ["--model", folder, "--tensor-parallel-size", "2", "--nnodes", "2"]
    argv += ["--node-rank", "1", "--master-port", str(port)]
    node1 = Service("decode", argv, tmp_path / "node1.log").start()
    try:
        prompts = random_prompts([6, 25], seed=9)
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        with LLM(folder, kv_cache_tokens=512, **nodes) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert llm.engine.runner.tp.size == 2
        hf = load_hf(Path(folder))
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 10, ignore_eos=True)
        assert node1.proc is not None and node1.proc.wait(30) == 0
    finally:
        node1.stop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(tensor_parallel_size=3, nnodes=2),
            r"3 x pipeline_parallel_size 1 = 3 ranks do not divide over nnodes=2",
        ),
        (dict(nnodes=2, node_rank=2), r"node_rank must be in \[0, nnodes - 1\] = \[0, 1\], got 2"),
        (
            dict(nnodes=2, tensor_parallel_size=2, distributed_executor_backend="ray"),
            "with distributed_executor_backend='ray' Ray places the ranks",
        ),
        (dict(distributed_executor_backend="spark"), "must be mp or ray, got 'spark'"),
    ],
)
def test_layouts_that_cannot_span_the_nodes_are_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_the_commands_refuse_them_at_start_up(capsys) -> None:
    argv = ["--tensor-parallel-size", "3", "--nnodes", "2", "--node-rank", "1"]
    assert pdmesh_main(["decode", *argv]) == 2
    assert "do not divide over nnodes=2" in capsys.readouterr().err
    # `pdmesh up` runs its workers on one machine: a multi-node worker is started per node.
    args = build_parser().parse_args(["up", "--nnodes", "2", "--tensor-parallel-size", "2"])
    with pytest.raises(ValueError, match="pdmesh decode / pdmesh prefill --nnodes N"):
        plan_mesh(args)


def test_pdmesh_up_hands_the_backend_to_its_workers() -> None:
    args = build_parser().parse_args(["up", "--distributed-executor-backend", "ray"])
    workers = [spec for spec in plan_mesh(args) if spec.name != "router"]
    assert [w.name for w in workers] == ["prefill-0", "decode-0"]
    for w in workers:
        flag = w.command.index("--distributed-executor-backend")
        assert w.command[flag + 1] == "ray"
