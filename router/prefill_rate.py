"""How fast prompts are prefilled, as the router measures it: seconds per prompt token, through
the prefill pool (queue included) and on decode workers themselves.

A prompt sent to a prefill worker is timed from its Submit to its first token and divided by
the tokens that worker had to compute before it could answer: those this router had sent it
and not yet seen come back (its queue), plus the prompt's own. A prompt prefilled on its decode
worker likewise: the uncached tokens of the prompts this router had given that worker to prefill
and not yet seen answered, plus its own. Each is a moving average (the last samples weigh
most), so it follows the load and the hardware the workers run on; until one is measured the
other stands in for it.

With these, `queue_wait_s(tokens)` estimates how long a prompt sent now would wait behind a
prefill worker's queue, and `local_s(tokens)` how long prefilling it on a decode worker would
stall that worker's batch: the dispatch policy's load-aware conditional disaggregation
(router/policies/base.py) and the planner (router/planner/) compare them.
"""

from __future__ import annotations

from pdmesh.router import metrics

# The weight of a new sample in the moving average: about the last ten prompts count.
SAMPLE_WEIGHT = 0.2


class PrefillRate:
    def __init__(self) -> None:
        self.remote_s_per_token: float | None = None
        self.local_s_per_token: float | None = None

    def observe(self, remote: bool, seconds: float, tokens: int) -> None:
        """A prompt's first token came `seconds` after its Submit; `tokens`: what was computed
        for it (remote: its prefill worker's queue ahead of it and its own uncached tokens)."""
        if tokens <= 0 or seconds <= 0:
            return
        sample = seconds / tokens
        old = self.remote_s_per_token if remote else self.local_s_per_token
        new = sample if old is None else old + SAMPLE_WEIGHT * (sample - old)
        if remote:
            self.remote_s_per_token = new
        else:
            self.local_s_per_token = new
        metrics.prefill_rate(remote, new)

    def queue_wait_s(self, queued_tokens: int) -> float | None:
        """Seconds a prompt would wait behind `queued_tokens` on a prefill worker (None: no rate
        measured yet)."""
        rate = self.remote_s_per_token or self.local_s_per_token
        return None if rate is None else queued_tokens * rate

    def local_s(self, tokens: int) -> float | None:
        """Seconds prefilling `tokens` on a decode worker would hold up its running batch."""
        rate = self.local_s_per_token or self.remote_s_per_token
        return None if rate is None else tokens * rate
