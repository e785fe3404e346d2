"""Watching an engine's steps through a benchmark run (rank 0's view): each step's wall time and
the tokens it launched, Python's garbage collections meanwhile, and a profile of a window of
steps on every rank, summarized by `step_timeline`."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

from pdmesh.bench.step_timeline import summarize_file
from pdmesh.engine.executor.profiling import ProfileRank, RankProfiler


class StepWatch:
    """The throughput run's engine steps, as rank 0's host sees them: each step's wall time and
    the tokens it launched (prefill and decode), and a profile of `PROFILED` steps on every rank
    starting at step `first` (while prompts are still being prefilled)."""

    PROFILED = 8

    def __init__(self, engine: Any, trace: Path, first: int, keep_traces: bool = False) -> None:
        self.engine, self.trace, self.first = engine, trace, first
        self.keep_traces = keep_traces  # every rank's Chrome trace beside the JSON
        self.rows: list[tuple[float, int, int]] = []  # (seconds, prefill tokens, decode tokens)
        self.profiler: RankProfiler | None = None
        self._originals = step, launch = engine.step, engine.runner.launch
        self.launched = [0, 0]
        self.span = (0.0, 0.0)  # the first step's start and the last one's end

        def counted_launch(batch: Any, *a: Any, **k: Any) -> Any:
            pairs = zip(batch.seqs, batch.num_new_tokens, strict=True)
            decode = sum(n == 1 and s.num_computed_tokens >= s.num_prompt_tokens for s, n in pairs)
            self.launched[0] += batch.num_tokens - decode
            self.launched[1] += decode
            return launch(batch, *a, **k)

        def timed_step() -> Any:
            i = len(self.rows)
            if i == self.first:
                self._profile(start=True)
            begin, self.launched = time.perf_counter(), [0, 0]
            deltas = step()
            end = time.perf_counter()
            self.rows.append((end - begin, *self.launched))
            self.span = (self.span[0] or begin, end)
            if i == self.first + self.PROFILED - 1:
                self._profile(start=False)
            return deltas

        engine.step, engine.runner.launch = timed_step, counted_launch
        # Python's garbage collections on rank 0 during the run: [count, seconds, longest].
        self.gc = {g: [0, 0.0, 0.0] for g in range(3)}
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_start
        g = self.gc[info["generation"]]
        g[0], g[1], g[2] = g[0] + 1, g[1] + pause, max(g[2], pause)

    def _profile(self, start: bool) -> None:
        driver = self.engine.tp_driver
        if start:
            self.profiler = RankProfiler()
            if driver is not None:
                driver.call(ProfileRank())
            self.profiler.start()
            return
        assert self.profiler is not None
        self.profiler.stop(f"{self.trace}.rank0.json")
        self.profiler = None
        if driver is not None:
            driver.call(ProfileRank(trace=str(self.trace)))

    def finish(self) -> dict[str, Any]:
        """Totals per kind of step (with prefill tokens, decode only) and each rank's timeline
        of the profiled steps."""
        if self.profiler is not None:  # the run ended within the window
            self._profile(start=False)
        self.engine.step, self.engine.runner.launch = self._originals
        gc.callbacks.remove(self._on_gc)
        kinds: dict[str, list[float]] = {"prefill": [0, 0, 0, 0], "decode_only": [0, 0, 0, 0]}
        for seconds, prefill, decode in self.rows:
            k = kinds["prefill" if prefill else "decode_only"]
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + seconds, k[2] + prefill, k[3] + decode
        out: dict[str, Any] = {
            kind: dict(steps=n, seconds=t, prefill_tokens=p, decode_tokens=d)
            for kind, (n, t, p, d) in kinds.items()
        }
        decode_ms = sorted(1e3 * t for t, prefill, _ in self.rows if not prefill)
        if decode_ms:
            out["decode_step_ms"] = {
                name: round(decode_ms[min(len(decode_ms) - 1, int(q * len(decode_ms)))], 2)
                for name, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0))
            }
        out["gc"] = {
            f"gen{g}": dict(count=n, ms=round(1e3 * t, 2), longest_ms=round(1e3 * m, 2))
            for g, (n, t, m) in self.gc.items()
        }
        out["steps_span_s"] = self.span[1] - self.span[0]  # the run's wall less add and output
        out["rows"] = [(round(1e3 * t, 3), p, d) for t, p, d in self.rows]  # (ms, prefill, decode)
        out["profiled_steps"] = profiled = self.rows[self.first : self.first + self.PROFILED]
        for r in range(self.engine.config.world_size):
            path = Path(f"{self.trace}.rank{r}.json")
            if path.exists():
                out[f"rank{r}"] = summarize_file(path, max(1, len(profiled)))
                if not self.keep_traces:
                    path.unlink()
        return out
