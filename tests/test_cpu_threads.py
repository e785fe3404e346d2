"""The CPU thread count a user sets holds for the whole run: Numba's OpenMP pool, when its first
parallel kernel starts it (the first decode step's attention), used to reset the process's count
to one thread per core, and torch's kernels followed (kernels/cpu/threads.py). Each check runs in
a process of its own: thread pools are per process, and this one's are already started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, torch, numba
from pdmesh import LLM, SamplingParams
llm = LLM({folder!r}, kv_cache_tokens=1024)
llm.generate([{{"prompt_token_ids": list(range(5, 40))}}], SamplingParams(max_tokens=4))
print(json.dumps([torch.get_num_threads(), numba.get_num_threads()]))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every count is 1")
def test_pdmesh_num_threads_holds_after_decode_steps(tiny_model) -> None:
    env = {**os.environ, "PDMESH_NUM_THREADS": "1"}
    code = SCRIPT.format(folder=str(tiny_model("llama")))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    torch_threads, numba_threads = json.loads(done.stdout.strip().splitlines()[-1])
    assert (torch_threads, numba_threads) == (1, 1)
