"""Keeping a burst of requests together: how long an idle serving loop waits for the rest.

Requests that a client sends together reach a worker a few milliseconds apart, each after its
own trip through the HTTP gateway, the router's tokenizer and the gRPC hops (8 of them spread
over ~20 ms on the 2-core CPU machine, BENCHMARKS.md issue 32). An idle engine that starts a
step on the first alone runs the others a whole prefill later; with fixed output lengths the
burst then stays split for good, and every later step that prefills one half lands in the other
half's decode (a 4 s inter-token gap on the CPU where steps are 0.1 s). Waiting a little for
the rest is worth it when the step about to run is long: the wait is a share (BURST_SHARE) of
the prefill's own estimated time, at most BURST_MAX_S. The estimate is the time a token has
cost in earlier prefill-heavy steps (launch to tokens read), so on a GPU, whose prefills take
milliseconds, the wait is a fraction of one.

Only where decode runs: a worker that only prefills (or a role-switching one while it serves
prefill) starts at once (EngineLoop's `gathers_bursts`). No decode runs there for a split burst
to land in, and a prompt that came alone does not pay the window: 5 ms of a 4,096-token prompt's
TTFT on an H200. The rest of a burst runs in the next step, where a compute-bound prefill costs
about what it would have cost joined.
"""

from __future__ import annotations

from pdmesh.engine.scheduling.batch import ScheduledBatch
from pdmesh.engine.scheduling.scheduler import Scheduler

BURST_SHARE = 0.05
BURST_MAX_S = 0.05
# Reading a step's tokens that took longer than this waited for the step (tokens already there
# are only copied): only then does launch-to-read time the step (StepLoop._handle).
COLLECT_WAITED_S = 0.0002
_MIN_TOKENS = 32  # a step counts as prefill-heavy with at least this many tokens
_EMA = 0.3  # the newest step's weight in the estimate


class PrefillRate:
    """Seconds a token costs in prefill-heavy steps, an exponential moving average."""

    def __init__(self) -> None:
        self.seconds_per_token: float | None = None

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        tokens = batch.num_tokens
        # Mostly prompt tokens: decode rows cost more a token (each reads the weights alone).
        if tokens < _MIN_TOKENS or len(batch.seqs) * 4 > tokens or seconds <= 0:
            return
        rate = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = rate if old is None else (1 - _EMA) * old + _EMA * rate

    def window_s(self, tokens: int) -> float:
        """The wait before a prefill of `tokens` (0 before any prefill was timed)."""
        if self.seconds_per_token is None:
            return 0.0
        return min(BURST_MAX_S, BURST_SHARE * self.seconds_per_token * tokens)

    def burst_window_s(self, scheduler: Scheduler, max_step_tokens: int) -> float:
        """The wait before the first step of an engine woken from idle: the window of the
        prefill that step runs (its waiting prompts); 0 while any sequence runs (its next token
        would wait), when nothing waits, and when the waiting prompts fill the step's budget
        already (nothing that arrives could join that step)."""
        if scheduler.running or not scheduler.waiting:
            return 0.0
        tokens = sum(seq.num_uncomputed_tokens for seq in scheduler.waiting)
        return 0.0 if tokens >= max_step_tokens else self.window_s(tokens)
