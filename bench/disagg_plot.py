"""CDFs of TTFT and inter-token latency, disaggregated against colocated, from the samples that
`pdmesh.bench.disagg_gpu` writes (matplotlib is needed here, not by pdmesh).

    python -m pdmesh.bench.disagg_plot SAMPLES.json [SAMPLES.json ...] --out cdf.png \
        --runs prefill_heavy/4,prefill_heavy/8,chat/8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdmesh.bench.latency_plot import draw_cdf

LAYOUTS = {"disagg_1p1d": "1 prefill + 1 decode", "colocated_2": "2 colocated"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("samples", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--runs", default="prefill_heavy/4,prefill_heavy/8,chat/8")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples: dict[str, dict[str, list[float]]] = {}
    for path in args.samples:
        samples.update(json.loads(path.read_text()))
    runs = args.runs.split(",")
    fig, axes = plt.subplots(2, len(runs), figsize=(4.5 * len(runs), 7), squeeze=False)
    for col, run in enumerate(runs):
        work, rate = run.split("/")
        for row, (metric, label) in enumerate((("ttft_ms", "TTFT"), ("itl_ms", "inter-token"))):
            ax = axes[row][col]
            title = f"{label}, {work.replace('_', '-')} at {rate} req/s"
            of = "tokens" if metric == "itl_ms" else "requests"
            for layout, name in LAYOUTS.items():
                values = samples.get(f"{layout}/{run}", {}).get(metric, [])
                draw_cdf(ax, values, title, of, name)
            ax.legend()
    fig.suptitle("Llama-3.1-8B shape, bf16, 2 x H200: disaggregated vs colocated")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
