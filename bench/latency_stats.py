"""Per-request streaming measurements and their summary (TTFT, TPOT, ITL, end-to-end, goodput).

Definitions follow vLLM's benchmark_serving: TTFT is send to the first token; TPOT is
(latency - TTFT) / (output tokens - 1); ITL is the gap between two streamed messages divided by
the tokens the later one carries, counted once per token (a message of k tokens after a gap g
is k inter-token latencies of g/k), so batched relays are not mistaken for fast ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds, from when it was sent)."""

    prompt_len: int
    expected_output_len: int
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    itls_s: list[float] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens > 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def on_message(self, elapsed_s: float, num_tokens: int, last_s: float | None) -> None:
        """A streamed message carrying `num_tokens` arrived `elapsed_s` after sending."""
        if num_tokens == 0:
            return
        if self.output_tokens == 0:
            self.ttft_s = elapsed_s
        elif last_s is not None:
            gap = (elapsed_s - last_s) / num_tokens
            self.itls_s.extend([gap] * num_tokens)
        self.output_tokens += num_tokens


def distribution_ms(values_s: list[float]) -> dict[str, float]:
    """mean / p50 / p90 / p99 in milliseconds (zeros when there are no values)."""
    if not values_s:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": round(float(arr.mean()), 3)}
    for p in PERCENTILES:
        out[f"p{p}"] = round(float(np.percentile(arr, p)), 3)
    return out


@dataclass(frozen=True)
class Slo:
    """Goodput targets; None: that bound is not checked. `itl_p99_ms` bounds each request's own
    99th-percentile inter-token latency (its stalls, which a mean per token hides)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_p99_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "itl_p99_ms"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"slo {name} must be > 0, got {v!r}.")

    @property
    def set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.itl_p99_ms))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft_s * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        if self.itl_p99_ms is not None and r.itls_s:
            return float(np.percentile(r.itls_s, 99)) * 1000 <= self.itl_p99_ms
        return True


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, object]:
    """The figures of one run: throughput, latency distributions, goodput."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary: dict[str, object] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": round(duration_s, 3),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": round(len(done) / duration_s, 3),
        "output_throughput": round(out_tokens / duration_s, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration_s, 2),
        "ttft_ms": distribution_ms([r.ttft_s for r in done]),
        "tpot_ms": distribution_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([x for r in done for x in r.itls_s]),
        "e2el_ms": distribution_ms([r.latency_s for r in done]),
    }
    if slo.set:
        good = sum(1 for r in records if slo.met(r))
        summary["slo"] = {k: v for k, v in vars(slo).items() if v is not None}
        summary["goodput"] = round(good / duration_s, 3)
        summary["good_requests"] = good
    errors = [r.error for r in records if r.error]
    if errors:
        summary["errors"] = errors[:5]
    wrong = [r for r in done if r.output_tokens != r.expected_output_len]
    if wrong:
        summary["wrong_output_lengths"] = len(wrong)
    return summary
