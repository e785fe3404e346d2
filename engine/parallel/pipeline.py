"""Pipeline parallelism: which layers a stage owns, and what crosses between stages.

A worker of TP t x PP p has t*p ranks; global rank r is TP rank r % t of stage r // t. Stage s
owns a contiguous range of decoder layers (the first also the embedding, the last the final norm
and the LM head) and a KV cache for those layers only. Each step, stage s receives the hidden
states and the residual ([2, T, H]) from the same TP rank of stage s - 1 and sends its own to
stage s + 1, point to point (NCCL on GPUs, gloo on CPUs: raw tensors, no pickle). TP rank 0 of
the last stage sends the logits of the rows to sample to global rank 0, which samples for all;
a step whose rows are all plain greedy it samples itself, and sends the token ids instead
(engine/runner/step_sampling.py).

The logits go back over a group of their own (`back`): NCCL runs a communicator's operations in
the order they were issued, so on one group rank 0's send of batch B's hidden states would wait
behind its receive of batch A's logits, and the stages would take turns instead of overlapping.
On a GPU rank 0 receives and samples them on a stream of their own (`sampling`): on the stream
that runs the stages, batch A's sampling would queue behind batch B's stage 0, launched before A's
logits came, and the host would wait for B's stage before it could schedule A's next step (the
stages took turns that way: 13.6 ms a decode step on two H100s, where each stage computes 7 ms).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdmesh import envs
from pdmesh.engine.config import EngineConfig
from pdmesh.engine.parallel.comm import IDLE_TIMEOUT
from pdmesh.engine.parallel.group import SINGLE, ParallelGroup


def layer_partition(num_layers: int, pp: int, spec: str | None = None) -> list[range]:
    """The layers of each of `pp` stages: `spec` ("16,16", PDMESH_PP_LAYER_PARTITION) or an
    even split whose extra layers go to the stages before the last (which runs the LM head)."""
    if pp > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {pp} is more than the model's {num_layers} layers: every "
            "stage needs at least one layer."
        )
    if spec:
        try:
            counts = [int(part) for part in spec.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(
                f"PDMESH_PP_LAYER_PARTITION={spec!r} must be {pp} positive layer counts that "
                f"add up to the model's {num_layers} layers."
            )
    else:
        base, extra = divmod(num_layers, pp)
        counts = [base] * pp
        for i in range(extra):
            counts[-2 - i] += 1
    starts = [sum(counts[:i]) for i in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, counts, strict=True)]


@dataclass(frozen=True)
class PipelineStage:
    """One rank's place in the pipeline. `world` spans every rank of the worker (TP x PP)."""

    index: int = 0
    size: int = 1
    layers: range | None = None  # None: every layer (no pipeline)
    tp_rank: int = 0
    tp_size: int = 1
    world: ParallelGroup = field(default=SINGLE)
    # Every rank again, for what goes back to rank 0 (the logits): see the module's docstring.
    back: Any = None
    # Every rank again, for the hidden states from stage to stage (few CTAs: see P2P_CTAS).
    ahead: Any = None
    # Sends to the next stage not known to be done: (work, tensor), oldest first.
    pending: deque[tuple[Any, torch.Tensor]] = field(default_factory=deque, compare=False)
    # GPU rank 0: where the logits are received and sampled (see the module's docstring).
    sampling: Any = field(default=None, compare=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def _rank(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send_next(self, carry: torch.Tensor) -> None:
        """This stage's hidden states and residual ([2, T, H]) to the next stage, without
        waiting: a send completes only when the next stage receives it, which is after it has
        finished the batch before (batches in flight). The oldest sends are waited for once
        more than one per stage are pending."""
        carry = carry.contiguous()
        work = dist.isend(carry, self._rank(self.index + 1), group=self.ahead)
        self.pending.append((work, carry))  # the tensor lives until its send is done
        while len(self.pending) > self.size:
            self.pending.popleft()[0].wait()

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.recv_into(torch.empty(shape, dtype=dtype, device=self.world.comm_device))

    def recv_into(self, out: torch.Tensor) -> torch.Tensor:
        """The previous stage's hidden states and residual into `out` ([2, T, H], contiguous:
        a decode graph's input buffer). On a GPU the host does not wait: the current stream
        does, before what it runs next."""
        dist.recv(out, self._rank(self.index - 1), group=self.ahead)
        return out

    @property
    def sends_back(self) -> bool:
        """TP rank 0 of the last stage of a pipeline: its logits (or tokens) go to global rank
        0."""
        return self.size > 1 and self.is_last and self.tp_rank == 0

    def send_back(self, out: torch.Tensor) -> None:
        """A step's logits [S, V], or its tokens [2, S] (engine/runner/step_sampling.py), to
        rank 0. Blocking: the stream waits for the send before it overwrites a graph's logits
        buffer."""
        dist.send(out.contiguous(), 0, group=self.back)

    def irecv_back(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Callable[[Callable[[torch.Tensor], None]], None]:
        """Post the receive of what the last stage sends back for a step (`send_back`); call the
        result with a function of it to run it once it is there. Posted at launch, the last stage's
        send completes while this rank runs the next batch: with several batches in flight
        neither side waits on the other. On a GPU the receive and the function run on
        `sampling`; the current stream waits for them only from where the result is called."""
        with _on(self.sampling):
            out = torch.empty(shape, dtype=dtype, device=self.world.comm_device)
            work = dist.irecv(out, (self.size - 1) * self.tp_size, group=self.back)

        def consume(use: Callable[[torch.Tensor], None]) -> None:
            with _on(self.sampling):
                work.wait()
                use(out)
            if self.sampling is not None:
                torch.cuda.current_stream().wait_stream(self.sampling)

        return consume


# The sends and receives between stages are posted ahead of their peers and spin on their SMs
# until the peer comes (rank 0's receive of the logits for most of a step, a stage's send of the
# next batch until the next stage has finished the one before): with NCCL's default CTAs they
# took those SMs from the stage's own kernels (rank 0 computed 8.25 ms a decode step against rank
# 1's 7.16 on two H100s; 6.86 ms with 4 CTAs for the logits). Few CTAs move a decode step's
# hidden states (4 MiB at 256 rows) or logits (64 MiB) well within a stage's step.
P2P_CTAS = 4


def _few_ctas(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    options = dist.ProcessGroupNCCL.Options()
    options.config.max_ctas = P2P_CTAS
    options._timeout = IDLE_TIMEOUT  # as the group's (else torch warns that they differ)
    return {"pg_options": options}


def _on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


SINGLE_STAGE = PipelineStage()


def check_world(config: EngineConfig, num_layers: int) -> None:
    """Refuse a layout that cannot run, before any rank starts (ValueError naming the counts)."""
    pp = config.pipeline_parallel_size
    if pp > 1:
        layer_partition(num_layers, pp, envs.pp_layer_partition())
    device = config.torch_device()
    # The ranks of this node (Ray places its actors, and checks their GPUs, itself).
    here = 1 if config.distributed_executor_backend == "ray" else config.ranks_per_node
    if device.type == "cuda" and here > 1:
        first, available = device.index or 0, torch.cuda.device_count()
        if first + here > available:
            per_node = f" / nnodes {config.nnodes}" if config.nnodes > 1 else ""
            raise ValueError(
                f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
                f"{pp}{per_node} needs {here} GPUs from cuda:{first}; {available} visible."
            )


def stage_of(rank: int, tp: int, pp: int, num_layers: int, world: ParallelGroup) -> PipelineStage:
    """This rank's stage; with pp > 1 every rank makes the `back` group here, in the same order."""
    if pp == 1:
        return PipelineStage(0, 1, None, rank % tp, tp, world)
    index = rank // tp
    layers = layer_partition(num_layers, pp, envs.pp_layer_partition())[index]
    device, ranks = world.comm_device, list(range(world.size))
    back = dist.new_group(ranks, timeout=IDLE_TIMEOUT, **_few_ctas(device))
    ahead = dist.new_group(ranks, timeout=IDLE_TIMEOUT, **_few_ctas(device))
    sampling = torch.cuda.Stream(device) if rank == 0 and device.type == "cuda" else None
    return PipelineStage(
        index, pp, layers, rank % tp, tp, world, back=back, ahead=ahead, sampling=sampling
    )
