"""Latency CDFs of a serving run as a PNG (matplotlib is optional: not a dependency)."""

from __future__ import annotations

from pdmesh.bench.latency_stats import RequestRecord


def plot_cdfs(records: list[RequestRecord], path: str) -> bool:
    """TTFT, TPOT, ITL and end-to-end latency CDFs to `path`; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    done = [r for r in records if r.ok]
    series = {
        "TTFT": [r.ttft_s * 1000 for r in done],
        "TPOT": [t * 1000 for r in done if (t := r.tpot_s) is not None],
        "ITL": [x * 1000 for r in done for x in r.itls_s],
        "end-to-end": [r.latency_s * 1000 for r in done],
    }
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.5))
    for ax, (name, values) in zip(axes, series.items(), strict=True):
        if values:
            xs = np.sort(np.asarray(values))
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs))
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
