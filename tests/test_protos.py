"""The committed Python stubs are exactly what the .proto files generate now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_stubs_are_fresh(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "protos" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / "protos" / rel
        assert committed.exists(), f"{rel} is not committed: run `make protos`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale: run `make protos`"
        )
    assert sys.modules.get("protogen") is None
