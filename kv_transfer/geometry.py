"""What one rank's KV pages look like: its layers, heads and block shape (`PageGeometry`), and
the overlap of two ranks' ranges. A rank holds global KV heads [head_start, head_start +
num_kv_heads) of global layers [layer_start, layer_start + num_layers); a pipeline stage's ranks
hold a layer range, a tensor-parallel rank a head range."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdmesh.kv_transfer.frame import DTYPE_CODES

_U32 = 1 << 32  # frame header fields are u32


def head_overlap(start_a: int, count_a: int, start_b: int, count_b: int) -> tuple[int, int]:
    """The global heads [lo, hi) in both ranges; empty when lo >= hi."""
    return max(start_a, start_b), min(start_a + count_a, start_b + count_b)


def check_count(owner: str, name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value < _U32:
        raise ValueError(f"{owner}.{name} must be an int in [{minimum}, 2**32), got {value!r}")


@dataclass(frozen=True)
class PageGeometry:
    """What one rank's pages look like."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # heads held by this rank
    head_start: int  # first global KV head held by this rank
    head_dim: int
    dtype: torch.dtype
    layer_start: int = 0  # first global layer held by this rank (a pipeline stage holds a range)

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            check_count("PageGeometry", name, getattr(self, name), 1)
        check_count("PageGeometry", "head_start", self.head_start, 0)
        check_count("PageGeometry", "layer_start", self.layer_start, 0)
        if self.dtype not in DTYPE_CODES:
            names = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
            raise ValueError(f"KV dtype {self.dtype} cannot be transferred; supported: {names}")

    @property
    def head_end(self) -> int:
        return self.head_start + self.num_kv_heads

    @property
    def layers(self) -> range:
        """The global layers this rank's cache holds (cache index i is layer layer_start + i)."""
        return range(self.layer_start, self.layer_start + self.num_layers)

    @property
    def bytes_per_block_per_head(self) -> int:
        """One block of one head of K (or of V) in one layer."""
        return self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        """One block of all this rank's heads, K and V, in one layer: a frame's cost per block."""
        return 2 * self.num_kv_heads * self.bytes_per_block_per_head

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """One block of one layer's K (or V): [block_size, num_kv_heads, head_dim]."""
        return self.block_size, self.num_kv_heads, self.head_dim

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, *self.page_shape)

    def check_pages(self, pages: torch.Tensor, lead: tuple[int, ...], what: str) -> None:
        """ValueError unless `pages` is [*lead, any number of blocks, block_size, num_kv_heads,
        head_dim] (one layer's pages: lead (2,); a whole cache: (num_layers, 2))."""
        n = len(lead)
        shape = (*pages.shape[:n], *pages.shape[n + 1 :])
        if pages.dim() != n + 4 or shape != (*lead, *self.page_shape):
            raise ValueError(f"{what} {list(pages.shape)} do not fit {self}")

    def check_cache(self, cache: torch.Tensor) -> int:
        """The cache's number of blocks; ValueError when it does not have this geometry."""
        if cache.dim() != 6 or tuple(cache.shape) != self.cache_shape(cache.shape[2]):
            expected = (
                f"[{self.num_layers}, 2, num_blocks, {self.block_size}, {self.num_kv_heads}, "
                f"{self.head_dim}]"
            )
            raise ValueError(f"KV cache of shape {list(cache.shape)} is not {expected}")
        if cache.dtype != self.dtype:
            raise ValueError(
                f"KV cache dtype {cache.dtype} differs from the geometry's {self.dtype}"
            )
        if not cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        return int(cache.shape[2])
