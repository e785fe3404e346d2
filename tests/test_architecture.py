"""The layer rules of docs/architecture.md hold: import-linter's contracts (.importlinter) pass.

The repository maps its top-level folders onto the `pdmesh` namespace (pyproject.toml's
package-dir), which import-linter cannot see through an editable install; the test lays the
namespace out as installed (a tree of links) and lints that."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(dest: Path) -> Path:
    """`dest/pdmesh/...` as `pip install .` would lay it out, made of links to the checkout."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = tool["package-dir"]
    for package in tool["packages"]:
        # The folder a package comes from: its own mapping, or its parent's plus its last name.
        parts = package.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in package_dir:
                source = ROOT / package_dir[".".join(parts[:i])] / Path(*parts[i:])
                break
        target = dest / Path(*parts)
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py*"):  # .py and .pyi
            (target / module.name).symlink_to(module)
    return dest


def test_import_linter_contracts_hold(tmp_path: Path) -> None:
    layout = installed_layout(tmp_path / "site")
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(layout)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "broken" in result.stdout and "0 broken" in result.stdout, result.stdout
