"""Model implementations, each registered under its Hugging Face architecture names."""

from pdmesh.engine.models.registry import model_class, register_model

__all__ = ["model_class", "register_model"]
