"""Fixtures for kv_transfer tests: real receivers and senders on loopback, closed after use."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from pdmesh.kv_transfer import KVReceiver, KVSender, PageGeometry, create_receiver, create_sender

LOOPBACK = "tcp://127.0.0.1:0"
SENTINEL = -7.0  # receiver caches start as this, so any stray write shows


def make_geometry(
    heads: int = 2,
    head_start: int = 0,
    dtype: torch.dtype = torch.float32,
    layers: int = 3,
    block_size: int = 4,
    head_dim: int = 8,
) -> PageGeometry:
    return PageGeometry(
        num_layers=layers,
        block_size=block_size,
        num_kv_heads=heads,
        head_start=head_start,
        head_dim=head_dim,
        dtype=dtype,
    )


@pytest.fixture
def geometry() -> Callable[..., PageGeometry]:
    return make_geometry


@pytest.fixture
def receiver() -> Iterator[Callable[..., KVReceiver]]:
    """receiver(geometry, num_blocks) -> a tcp receiver over a cache filled with SENTINEL."""
    opened: list[KVReceiver] = []

    def make(geometry: PageGeometry, num_blocks: int = 12) -> KVReceiver:
        cache = torch.full(geometry.cache_shape(num_blocks), SENTINEL, dtype=geometry.dtype)
        opened.append(create_receiver("tcp", cache, geometry, LOOPBACK))
        return opened[-1]

    yield make
    for r in opened:
        r.close()


@pytest.fixture
def sender() -> Iterator[Callable[[PageGeometry], KVSender]]:
    opened: list[KVSender] = []

    def make(geometry: PageGeometry) -> KVSender:
        opened.append(create_sender("tcp", geometry))
        return opened[-1]

    yield make
    for s in opened:
        s.close()


def _random_cache(geometry: PageGeometry, num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(geometry.cache_shape(num_blocks), generator=g).to(geometry.dtype)


@pytest.fixture
def random_cache() -> Callable[..., torch.Tensor]:
    """random_cache(geometry, num_blocks, seed) -> [L, 2, num_blocks, block_size, heads, dim]."""
    return _random_cache


@pytest.fixture
def sentinel() -> float:
    return SENTINEL


@pytest.fixture
def eventually() -> Callable[[Callable[[], bool]], None]:
    """Poll a condition that another thread makes true; fail after 3 s."""

    def wait(condition: Callable[[], bool], timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not met within 3 s")
            time.sleep(0.005)

    return wait
