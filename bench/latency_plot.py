"""Latency CDFs of a serving run as a PNG (matplotlib is optional: not a dependency)."""

from __future__ import annotations

from typing import Any

from pdmesh.bench.latency_stats import RequestRecord


def draw_cdf(ax: Any, ms: list[float], title: str, of: str, label: str | None = None) -> None:
    """The CDF of the values `ms` on matplotlib axes `ax` (a fraction `of` what they count)."""
    import numpy as np

    if ms:
        xs = np.sort(np.asarray(ms))
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel(f"fraction of {of}")
    ax.grid(True, alpha=0.3)


def plot_cdfs(records: list[RequestRecord], path: str) -> bool:
    """TTFT, TPOT, ITL and end-to-end latency CDFs to `path`; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft_s * 1000 for r in done],
        "TPOT": [t * 1000 for r in done if (t := r.tpot_s) is not None],
        "ITL": [x * 1000 for r in done for x in r.itls_s],
        "end-to-end": [r.latency_s * 1000 for r in done],
    }
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        draw_cdf(ax, values, name, "tokens" if name == "ITL" else "requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
