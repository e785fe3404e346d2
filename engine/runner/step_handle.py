"""A step launched on the device: what the host reads back from it once it is off."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdmesh.engine.outputs import PositionLogprobs
from pdmesh.engine.sample.logprobs import TopLogprobs


@dataclass
class StepHandle:
    """A step launched on the device whose sampled tokens have not been read yet."""

    num_seqs: int
    sample_seq_index: list[int]  # [S]: the batch row of each sampled token
    tokens: torch.Tensor | None  # [S] int64 on the runner's device (None: nothing sampled)
    # [S] int64: `tokens` with a negative code where a row could not be sampled (what the host
    # reads; see engine/outputs.py's NO_ALLOWED_TOKEN and NON_FINITE_LOGITS).
    flagged: torch.Tensor | None = None
    # On a GPU: the tokens' copy in pinned host memory, and an event recorded after it. Waiting
    # on the event, not on the stream, leaves a step launched after this one running.
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    # Pipeline stages: the logits are still on their way from the last stage; `sample` waits
    # for them and sets `tokens` (`read` calls it).
    sample: Callable[[], None] | None = None
    # Rows asking for log-probabilities: those of the sampled tokens, and what each row asked.
    logprobs: tuple[TopLogprobs, list[int | None]] | None = None
    # Prompt positions' log-probabilities: (batch row, position, entry) of each.
    prompt_logprobs: list[tuple[int, int, PositionLogprobs]] = field(default_factory=list)
    # Speculative decoding: the draft tokens this step verifies (engine/spec_decode/verify.py's
    # `Verify`); `tokens` then has a row per draft too. None: a plain step.
    verify: Any = None

    def read(self) -> list[int]:
        if self.sample is not None:
            self.sample()
        if self.tokens is None:
            return []
        if self.copied is None:
            return (self.flagged if self.flagged is not None else self.tokens).tolist()
        # Lets go of the GIL while it waits: the process's other threads (gRPC, KV receivers)
        # run meanwhile.
        self.copied.synchronize()
        assert self.host_tokens is not None
        return self.host_tokens.tolist()
