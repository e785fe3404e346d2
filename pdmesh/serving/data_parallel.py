"""Which data-parallel rank a worker process is: a worker of `data_parallel_size` N runs as N
processes, each a worker with its own port, requests, KV cache and KV plane (the router sees N
workers); under data-parallel attention their MoE layers share the experts (lockstep.py).
Light on purpose: the services' configs import it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelRank:
    """Which of its worker's `data_parallel_size` ranks a worker process is (0-based), and
    where rank 0 listens for the others (HOST:PORT, the MoE group's rendezvous)."""

    rank: int
    address: str

    def check(self, size: int) -> None:
        if not 0 <= self.rank < size:
            raise ValueError(
                f"--data-parallel-rank must be in 0 .. {size - 1} (data_parallel_size {size}), "
                f"got {self.rank}."
            )
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(
                f"--data-parallel-address wants HOST:PORT (where rank 0 listens), got "
                f"{self.address!r}."
            )


def check_rank(size: int, dp: DataParallelRank | None) -> None:
    """A worker of `data_parallel_size` > 1 is one of its ranks and says which."""
    if size > 1 and dp is None:
        raise ValueError(
            f"a worker of data_parallel_size {size} is one of {size} ranks, each a worker with "
            "its own port: start each with --data-parallel-rank R and --data-parallel-address "
            "HOST:PORT (where rank 0 listens); `pdmesh up --data-parallel-size N` does this."
        )
    if dp is not None:
        dp.check(size)
