"""Model implementations, each registered under its Hugging Face architecture names
(`registry.py`), and what the engine reads of a model folder (`info.py`).

May import: `engine.layers`, `engine.parallel` (groups and pipeline stages), `engine.weights` and
the checkpoint config. Never the runner, the scheduler or the engine loop (an import-linter
contract).
"""

from pdmesh.engine.models.registry import model_class, register_model

__all__ = ["model_class", "register_model"]
