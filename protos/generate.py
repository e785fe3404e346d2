"""Regenerate the Python stubs beside the .proto files: `python protos/generate.py [OUT]`."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
    ]
    if protoc.main([*args, *protos]) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
