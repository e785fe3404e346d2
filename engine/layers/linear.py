"""Linear layers, Megatron-style: column-parallel (output split) and row-parallel (input split,
then all-reduce). Each parameter carries a `weight_loader` that reads only this rank's part of a
checkpoint tensor and writes it with `store_rows` (which quantizes it where a quantization
method replaced the weight). Forward passes go through the layer's `quant_method`.
"""

from __future__ import annotations

import torch
from torch import nn

from pdmesh.engine.layers.quantization.base import UNQUANTIZED, LinearMethod
from pdmesh.engine.layers.quantization.rows import store_rows
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup
from pdmesh.engine.weights import CheckpointTensor


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None):
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(
            f"checkpoint shape {tuple(loaded.shape)} != parameter {tuple(param.shape)}"
        )
    if param.dim():
        store_rows(param, 0, loaded.load())
    else:
        param.data.copy_(loaded.load())


class ReplicatedLinear(nn.Module):
    quant_method: LinearMethod = UNQUANTIZED

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class _ShardedLinear(nn.Module):
    """y = x W^T (+ b) with W: [out, in] split across the ranks of `tp` along `split_dim`."""

    split_dim: int  # 0: the outputs (column parallel), 1: the inputs (row parallel)
    quant_method: LinearMethod = UNQUANTIZED

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: ParallelGroup = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        shape = [out_features, in_features]
        what = ("output features", "input features")[self.split_dim]
        shape[self.split_dim] = tp.shard(shape[self.split_dim], what)
        self.weight = _param(*shape)
        self.weight.weight_loader = self.weight_loader
        self.bias = _param(shape[0]) if bias else None
        # A bias is split with the outputs; behind a row-parallel layer it is whole on every rank.
        if self.bias is not None and self.split_dim == 0:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        size = param.shape[self.split_dim] if param.dim() > self.split_dim else 0
        store_rows(param, 0, loaded.narrow(self.split_dim, self.tp.rank * size, size))


class ColumnParallelLinear(_ShardedLinear):
    """y = x W^T with W's rows (outputs) split across ranks; the output stays split."""

    split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (gate | up)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        local = [s // self.tp.size for s in self.output_sizes]
        offset = sum(local[:shard_id])
        size = local[shard_id]
        store_rows(param, offset, loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix, split by heads. With fewer KV heads than ranks,
    each KV head is replicated over `size / num_kv_heads` ranks (as vLLM does)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp: ParallelGroup = SINGLE,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = tp.shard(num_heads, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "KV heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"parallel size {tp.size} is not a multiple of {num_kv_heads} KV heads"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        out_global = (self.num_heads * tp.size + 2 * self.num_kv_heads * tp.size) * head_dim
        super().__init__(hidden_size, out_global, bias, tp)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        d = self.head_dim
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, self.kv_head_start * d
        else:  # "v"
            offset, size, start = self.q_size + self.kv_size, self.kv_size, self.kv_head_start * d
        store_rows(param, offset, loaded.narrow(0, start, size))


class RowParallelLinear(_ShardedLinear):
    """y = x W^T with W's columns (inputs) split across ranks; partial sums are all-reduced."""

    split_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(self.quant_method.apply(self, x, None))

    def forward_gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The projection of silu(gate) * up, from an MLP's [gate | up] output: one kernel for
        both where the GEMV takes it (a batch-1 decode step)."""
        return self._reduce(self.quant_method.apply_gated(self, gate_up, None))

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y
