"""pdmesh: an LLM-serving mesh with disaggregated prefill and decode.

The offline API mirrors vLLM's names so users can switch::

    from pdmesh import LLM, SamplingParams
    llm = LLM()  # the embedded default model (SmolLM2-135M-Instruct)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


def drop_checkout_root() -> None:
    """Take this checkout's root off sys.path (`python -m` from the checkout puts it there).

    Its folders install as pdmesh.* subpackages (kernels/ is pdmesh.kernels); seen from the root
    they are top-level packages too, and `kernels` then shadows the Hugging Face package of that
    name, which transformers (5.25 and newer) imports when it is installed. An installed pdmesh
    sits in site-packages, beside that very package: nothing is done there."""
    root = Path(__file__).resolve().parent.parent
    checkout = (root / "pyproject.toml").is_file() and (root / "engine" / "llm_engine.py").is_file()
    if not checkout:
        return
    for entry in list(sys.path):
        if Path(entry or ".").resolve() == root:
            sys.path.remove(entry)


drop_checkout_root()

if TYPE_CHECKING:
    from pdmesh.engine.llm import LLM
    from pdmesh.engine.outputs import CompletionOutput, RequestOutput
    from pdmesh.sampling_params import SamplingParams

_LAZY = {
    "LLM": "pdmesh.engine.llm",
    "SamplingParams": "pdmesh.sampling_params",
    "RequestOutput": "pdmesh.engine.outputs",
    "CompletionOutput": "pdmesh.engine.outputs",
}

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Importing torch takes seconds; `import pdmesh` (the CLI's --help, say) should not.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pdmesh' has no attribute {name!r}")
