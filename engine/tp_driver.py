"""Rank 0 of a tensor-parallel worker: starts the follower ranks and drives them.

Followers are separate processes (`python -m pdmesh.engine.tp_follower`), configured by JSON in
their environment, that die with rank 0 (PR_SET_PDEATHSIG). Each step rank 0 broadcasts the
flat step inputs; every rank runs the same forward on its shard. A follower that dies is noticed
by a monitor thread within a fraction of a second; the worker then reports it and goes down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from pdmesh.engine import step_codec
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.distributed import (
    broadcast_bytes,
    broadcast_ints,
    destroy,
    free_port,
    gather_bytes,
    init_group,
)
from pdmesh.engine.model_runner import ModelRunner
from pdmesh.engine.parallel import ParallelGroup
from pdmesh.engine.step_inputs import StepInputs
from pdmesh.logger import get_logger

log = get_logger(__name__)

OP_STEP, OP_CONTROL, OP_STOP = 1, 2, 3
MONITOR_INTERVAL_S = 0.2


def rank_device(base: torch.device, rank: int) -> torch.device:
    if base.type == "cuda":
        return torch.device("cuda", (base.index or 0) + rank)
    return base


def _die_with_parent() -> None:
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class TPDriver:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        extension: str | None = None,
        extension_options: dict[str, Any] | None = None,
    ) -> None:
        size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, size):
            spec = {
                "engine": dataclasses.asdict(config),
                "rank": rank,
                "size": size,
                "init_method": init_method,
                "device": str(rank_device(device, rank)),
                "extension": extension,
                "extension_options": extension_options or {},
            }
            env = {**os.environ, "PDMESH_TP_SPEC": json.dumps(spec)}
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pdmesh.engine.tp_follower"],
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            )
        self.on_rank_death: Callable[[str], None] | None = None
        self._stopping = False
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        self.group: ParallelGroup = init_group(
            0, size, init_method, rank_device(device, 0), config.enable_expert_parallel
        )

    def attach(self, runner: ModelRunner) -> None:
        runner.before_forward = self._send_step

    def _send_step(self, inputs: StepInputs, plan: torch.Tensor | None) -> None:
        step_codec.send(OP_STEP, inputs, plan, self.group)

    def control(self, op: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        """Run control `op` on every follower (between steps); their replies, rank 1 first."""
        broadcast_ints([OP_CONTROL], step_codec.HEADER_LEN, self.group)
        broadcast_bytes(json.dumps({"op": op, "args": args}).encode(), self.group)
        replies = gather_bytes(b"", self.group)
        return [json.loads(r) if r else {} for r in replies[1:]]

    def _watch(self) -> None:
        import time

        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    message = f"tensor-parallel rank {rank} exited with code {code}"
                    log.error(message)
                    if self.on_rank_death is not None:
                        self.on_rank_death(message)
                    return
            time.sleep(MONITOR_INTERVAL_S)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            if all(p.poll() is None for p in self.procs):
                broadcast_ints([OP_STOP], step_codec.HEADER_LEN, self.group)
        except RuntimeError as e:
            log.warning("could not stop the followers cleanly: %s", e)
        for proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        destroy()
