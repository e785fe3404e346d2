"""Settings of a worker that takes either role."""

from __future__ import annotations

from dataclasses import dataclass

from pdmesh.decode_service.config import DecodeConfig

ROLES = ("prefill", "decode")


def check_role(role: str) -> None:
    """ValueError unless `role` is one a worker can take."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}.")


@dataclass(frozen=True)
class WorkerConfig(DecodeConfig):
    """A decode worker's settings (its decode role), and: role: the role it starts in;
    kv_send_timeout_s: how long pushing one prompt's KV may take in its prefill role (as a
    prefill worker's)."""

    role: str = "decode"
    kv_send_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_role(self.role)
        if self.kv_send_timeout_s <= 0:
            raise ValueError(f"kv_send_timeout_s must be > 0, got {self.kv_send_timeout_s!r}.")
        if self.engine.data_parallel_size > 1:
            raise ValueError(
                "a worker that changes role runs one data-parallel rank for now (its ranks "
                "would have to switch together); start `pdmesh decode` or `pdmesh prefill`."
            )
        if self.engine.pipeline_parallel_size > 1:
            # The engine keeps one step per stage in flight unless its connector plans steps
            # from the start; this one plans only while it pushes.
            raise ValueError(
                "a worker that changes role runs one pipeline stage for now; start `pdmesh "
                "decode` or `pdmesh prefill` for pipeline-parallel workers."
            )
