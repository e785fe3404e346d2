"""A follower rank of a tensor-parallel worker: `python -m pdmesh.engine.tp_follower`.

It loads its shard of the model and then runs whatever rank 0 broadcasts: steps (the same
forward as rank 0 on its shard), control operations (handled by a service's rank extension,
e.g. registering a KV transfer on this rank's receiver), or stop.
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Protocol

import torch

from pdmesh import envs
from pdmesh.engine import step_codec
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.distributed import broadcast_bytes, destroy, gather_bytes, init_group
from pdmesh.engine.model_info import ModelInfo
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.model_source import resolve_model_folder
from pdmesh.engine.parallel import ParallelGroup
from pdmesh.engine.tp_driver import OP_CONTROL, OP_STEP, OP_STOP, _die_with_parent
from pdmesh.logger import get_logger

log = get_logger(__name__)


class RankExtension(Protocol):
    """A service's code on a follower rank (KV receivers / senders of that rank)."""

    def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


def load_extension(
    path: str, runner: ModelRunner, group: ParallelGroup, options: dict[str, Any]
) -> RankExtension:
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(runner, group, options)


def build_runner(
    config: EngineConfig, info: ModelInfo, device: torch.device, group: ParallelGroup
) -> ModelRunner:
    from pdmesh.engine.llm_engine import resolve_max_model_len

    return ModelRunner(info, config, device, resolve_max_model_len(config, info), tp=group)


def serve_rank(spec: dict[str, Any]) -> None:
    config = EngineConfig(**spec["engine"])
    device = torch.device(spec["device"])
    group = init_group(
        spec["rank"], spec["size"], spec["init_method"], device, config.enable_expert_parallel
    )
    info = ModelInfo.load(resolve_model_folder(config.model))
    runner = build_runner(config, info, device, group)
    ext = (
        load_extension(spec["extension"], runner, group, spec["extension_options"])
        if spec.get("extension")
        else None
    )
    try:
        while True:
            header = step_codec.receive_header(group)
            op = header["op"]
            if op == OP_STEP:
                inputs, plan = step_codec.receive_step(header, group, device)
                runner.forward_with_plan(inputs, plan)
            elif op == OP_CONTROL:
                msg = json.loads(broadcast_bytes(None, group))
                reply = _control(runner, ext, msg["op"], msg["args"])
                gather_bytes(json.dumps(reply).encode(), group)
            elif op == OP_STOP:
                return
            else:
                raise RuntimeError(f"unknown op {op} from rank 0")
    finally:
        if ext is not None:
            ext.close()
        destroy()


def _control(
    runner: ModelRunner, ext: RankExtension | None, op: str, args: dict[str, Any]
) -> dict[str, Any]:
    if op == "expert_counts":
        return {"counts": runner.expert_counts() or []}
    if op == "all_to_all_count":
        return {"count": runner.tp.counters["all_to_all"]}
    if ext is None:
        raise RuntimeError(f"control op {op!r} needs a rank extension")
    return ext.handle(op, args)


def main() -> None:
    _die_with_parent()
    serve_rank(json.loads(envs.tp_spec()))


if __name__ == "__main__":
    main()
