"""A request's span timeline from console-exported OpenTelemetry spans (OTEL_TRACES_EXPORTER=
console, every process printing its spans as JSON objects among its other output): where each
hop's span starts and ends, in ms from the trace's root span (bench/disagg_gpu.py --trace)."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any


def read_spans(path: Path) -> list[dict[str, Any]]:
    """The spans in a file of console-exported ones (JSON objects among other lines)."""
    text, decoder, i, found = path.read_text(), json.JSONDecoder(), 0, []
    while (i := text.find("{\n", i)) != -1:
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        if isinstance(obj, dict) and "context" in obj and "start_time" in obj:
            found.append(obj)
    return found


def _unix_ms(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1e3


def span_timeline(spans: list[dict[str, Any]], since_ms: float) -> dict[str, list[float]]:
    """Over the traces whose root started after `since_ms` (unix ms): each span's median [start,
    end] in ms from its trace's root, keyed `service/name`, in order of start."""
    traces: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        traces.setdefault(span["context"]["trace_id"], []).append(span)
    roots = [
        (t0, tid)
        for tid, t in traces.items()
        for s in t
        if not s["parent_id"] and (t0 := _unix_ms(s["start_time"])) >= since_ms
    ]
    offsets: dict[str, list[tuple[float, float]]] = {}
    for t0, tid in roots:
        for s in traces[tid]:
            key = f"{s['resource']['attributes'].get('service.name', '?')}/{s['name']}"
            offsets.setdefault(key, []).append(
                (_unix_ms(s["start_time"]) - t0, _unix_ms(s["end_time"]) - t0)
            )
    table = {
        key: [round(statistics.median(x[i] for x in v), 2) for i in (0, 1)]
        for key, v in offsets.items()
    }
    return dict(sorted(table.items(), key=lambda kv: kv[1]))
