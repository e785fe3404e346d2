"""The distribution's shape: one `pdmesh` namespace mapped from the architecture folders."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed_under_pdmesh() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(tool["packages"]), tool["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == packages
    assert all(p == "pdmesh" or p.startswith("pdmesh.") for p in packages)


def test_import_pdmesh_is_light_and_exports_the_offline_api() -> None:
    code = (
        "import sys, pdmesh; assert 'torch' not in sys.modules; "
        "from pdmesh import LLM, SamplingParams; print(LLM.__module__, SamplingParams.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["pdmesh.engine.llm", "SamplingParams"]


def test_the_command_line_parser_imports_no_torch() -> None:
    # Every `pdmesh` command builds the whole parser, engine flags included: the router and
    # `pdmesh healthcheck` must not pay for torch.
    code = (
        "import sys; from pdmesh.cli import build_parser; build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_no_top_level_name_but_pdmesh() -> None:
    # `kernels` and `router` would collide with other distributions (docs/architecture.md):
    # Hugging Face's `kernels`, a dependency of transformers 5.25 and newer, may be installed; none
    # of these names may lead to this checkout's folders.
    root = Path(__file__).resolve().parent.parent
    names = ("kernels", "router", "engine", "kv_transfer")
    code = (
        "import importlib.util as u\n"
        f"specs = [(n, u.find_spec(n)) for n in {names!r}]\n"
        f"print([n for n, s in specs if s and str(s.origin).startswith({str(root)!r} + '/' + n)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == "[]"
