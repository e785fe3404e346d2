"""Run another benchmark with one kernel replaced by its reference (a fused kernel: by the
kernels it replaced), to measure the kernel against what came before it in the same call.

    python -m pdmesh.bench.without_kernel KERNEL MODULE [ARGS...]
    python -m pdmesh.bench.without_kernel rotary_and_store_kv pdmesh.bench.gpu --only moe --out OUT

KERNEL is a wrapper's name in pdmesh.kernels (its `pick` name); MODULE runs as `python -m MODULE
ARGS` would.
"""

from __future__ import annotations

import runpy
import sys

from pdmesh.kernels.backend import run_reference


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        raise SystemExit(__doc__)
    kernel, module, rest = args[0], args[1], args[2:]
    run_reference(kernel)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__")


if __name__ == "__main__":
    main()
