"""What the engine needs to know about a model, read from its Hugging Face folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmesh.checkpoint.config import ModelConfig
from pdmesh.engine.models import model_class
from pdmesh.engine.models.hf_config import read_config
from pdmesh.engine.models.llama import head_dim_of


@dataclass(frozen=True)
class ModelInfo:
    folder: Path
    hf_config: Any
    model_cls: type
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, folder: Path) -> ModelInfo:
        hf_config = read_config(folder)
        model_cls = model_class(hf_config)
        meta = ModelConfig.load(folder)  # the eos ids the router uses too
        return cls(
            folder=folder,
            hf_config=hf_config,
            model_cls=model_cls,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim_of(hf_config),
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            max_position=getattr(hf_config, "max_position_embeddings", 4096),
            eos_token_ids=meta.eos_token_ids,
        )

    def check_parallel(
        self, size: int, expert_parallel: bool, eplb_redundant: int | None = None
    ) -> None:
        """ValueError (naming the counts and the valid sizes) when `size` ranks cannot split
        this model; checked before any rank is started. eplb_redundant: EPLB's redundant
        experts (None: EPLB off)."""
        c = self.hf_config
        num_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0)
        if eplb_redundant is not None:
            from pdmesh.engine.eplb.placement import check_eplb

            check_eplb(num_experts, eplb_redundant, size)
            num_experts += eplb_redundant  # the physical experts split over the ranks
        if size == 1:
            return
        from pdmesh.engine.parallel.comm import check_tp_size

        check_tp_size(size, self.num_heads, self.num_kv_heads)
        sizes = {"intermediate_size": getattr(c, "intermediate_size", 0)}
        if num_experts and expert_parallel:
            if num_experts % size:
                raise ValueError(
                    f"expert parallelism over {size} ranks needs this model's {num_experts} "
                    "experts to divide evenly."
                )
        elif num_experts:
            sizes["moe_intermediate_size"] = (
                getattr(c, "moe_intermediate_size", None) or c.intermediate_size
            )
        for name, value in sizes.items():
            if value and value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide {name} {value}.")

    @property
    def num_experts(self) -> int:
        """The routed experts of each MoE layer (0: a dense model)."""
        c = self.hf_config
        return getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0) or 0

    def check_data_parallel(
        self, size: int, expert_parallel: bool, eplb_redundant: int | None = None
    ) -> None:
        """ValueError (naming the counts) when the experts cannot split over `size` data-
        parallel ranks (expert parallelism with data-parallel attention)."""
        if not (expert_parallel and self.num_experts):
            return
        if eplb_redundant is not None:
            from pdmesh.engine.eplb.placement import check_eplb

            check_eplb(self.num_experts, eplb_redundant, size)
        elif self.num_experts % size:
            raise ValueError(
                f"expert parallelism over data_parallel_size={size} ranks needs this model's "
                f"{self.num_experts} experts to divide evenly."
            )

    def kv_block_bytes(self, block_size: int, itemsize: int) -> int:
        """One block's KV over every layer and KV head (what all of a worker's ranks hold)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * block_size * itemsize

    @property
    def name(self) -> str:
        return getattr(self.hf_config, "_name_or_path", "") or self.folder.name
