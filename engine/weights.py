"""Reading Hugging Face safetensors checkpoints (single file or sharded index) into a model.

Tensors are read lazily: a parameter's `weight_loader` narrows a `CheckpointTensor` to the part
its rank needs, and only those bytes are read from disk.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn


class CheckpointTensor:
    """A tensor in a safetensors file, read only when (part of) it is asked for."""

    def __init__(self, name: str, handle: Any) -> None:
        self.name = name
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"{self.name}: cannot read [{start}, {start + length}) of dim {dim} of {self.shape}"
            )
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def load(self) -> torch.Tensor:
        # A 0-dim tensor (an FP8 checkpoint's per-tensor scale) cannot be sliced.
        return self._slice[:] if self.shape else self._handle.get_tensor(self.name)


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {folder}")
    return files


def iter_checkpoint(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    with ExitStack() as stack:
        for path in checkpoint_files(folder):
            if not path.exists():
                raise ValueError(f"model: weight shard {path.name} listed in the index is missing")
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, CheckpointTensor(name, handle)


class InMemoryTensor:
    """A tensor already in memory, with the `CheckpointTensor` interface (benchmarks load a
    peer's weights this way, so both run the very same numbers)."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name = name
        self._tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._tensor.narrow(dim, start, length)

    def load(self) -> torch.Tensor:
        return self._tensor


class WeightMapped(Protocol):
    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None: ...


def load_weights(model: nn.Module, folder: Path) -> None:
    """Load every parameter of `model` from the checkpoint in `folder`."""
    load_named(model, iter_checkpoint(folder), str(folder))


def load_named(
    model: nn.Module, tensors: Iterable[tuple[str, Any]], source: str = "the weights"
) -> None:
    """Load every parameter of `model` from (checkpoint name, tensor) pairs.

    The model maps each checkpoint name to (parameter name, shard id) or None to skip it; a
    parameter with a `weight_loader` places its shard, others are copied whole.
    """
    from pdmesh.engine.layers.linear import default_weight_loader

    params = dict(model.named_parameters())
    loaded: set[str] = set()
    mapper: WeightMapped = model  # type: ignore[assignment]
    with torch.no_grad():
        for name, tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                tensor = InMemoryTensor(name, tensor)
            target = mapper.map_checkpoint_name(name)
            if target is None:
                continue
            param_name, shard_id = target
            param = params.get(param_name)
            if param is None:
                continue  # held by another rank (expert parallelism) or unused by this model
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard_id)
            loaded.add(param_name)
    missing = sorted(n for n in set(params) - loaded if not _scale_made_at_load(n, params))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"model: {source} lacks {len(missing)} weights: {shown}")


def _scale_made_at_load(name: str, params: dict[str, nn.Parameter]) -> bool:
    """Whether `name` is an FP8 weight's scales that quantizing its rows made (a bf16 checkpoint),
    so the checkpoint need not hold them. Rows copied as float8 need the checkpoint's scales."""
    if not getattr(params[name], "is_fp8_scale", False):
        return False
    weight = params.get(name.removesuffix("_scale"))
    return weight is not None and not getattr(weight, "fp8_rows_copied", False)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (load_format="dummy"): for speed measurements only."""
    from pdmesh.engine.layers.quantization.rows import store_rows

    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if getattr(param, "is_fp8_scale", False):
                continue  # set with its fp8 weight, below
            if param.dim() == 1:
                param.fill_(1.0)  # norms
                continue
            # Drawn where the parameter lives: tens of GB take seconds on a GPU.
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            if hasattr(param, "fp8_scale"):  # fp8: drawn in bf16, quantized one expert at a time
                slots = [None] if param.dim() == 2 else range(param.shape[0])
                for slot in slots:
                    drawn = torch.empty(param.shape[-2:], dtype=torch.bfloat16, device=param.device)
                    store_rows(param, 0, drawn.normal_(0.0, 0.02, generator=gen), slot)
                continue
            param.normal_(0.0, 0.02, generator=gen)
