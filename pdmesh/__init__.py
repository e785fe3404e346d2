"""pdmesh: an LLM-serving mesh with disaggregated prefill and decode.

The offline API mirrors vLLM's names so users can switch::

    from pdmesh import LLM, SamplingParams
    llm = LLM()  # the embedded default model (SmolLM2-135M-Instruct)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

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
