"""The `pdmesh` command as a user runs it: a real process."""

from __future__ import annotations

import json
import subprocess
import sys

from support import hf_greedy, load_hf

PDMESH = [sys.executable, "-m", "pdmesh.cli"]


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
    from pdmesh.launcher import pair_transports

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
