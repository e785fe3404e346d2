"""`python -m pdmesh...` from the checkout: its root's folders do not shadow installed packages.

transformers (5.25 and newer) depends on Hugging Face's `kernels` package and imports it; the
checkout's kernels/ folder (pdmesh.kernels) has the same top-level name when the checkout's root
is on sys.path, as `python -m` puts it from there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_transformers_imports_beside_the_checkout_root() -> None:
    code = (
        "import sys, pdmesh, transformers.activations\n"
        "import importlib.util as u\n"
        "spec = u.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip().startswith(str(ROOT / "kernels")), done.stdout


def test_an_installed_pdmesh_leaves_site_packages_on_the_path(tmp_path) -> None:
    """pdmesh/__init__.py in a folder laid out as site-packages, beside a `kernels` package (as
    Hugging Face's is there): importing it keeps that folder on sys.path."""
    site = tmp_path / "site-packages"
    (site / "pdmesh").mkdir(parents=True)
    (site / "pdmesh" / "__init__.py").write_text((ROOT / "pdmesh" / "__init__.py").read_text())
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("NAME = 'the installed kernels package'\n")
    code = "import pdmesh, kernels, sys; print(kernels.NAME); print(sys.path.count(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(site)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["the installed kernels package", "1"], done.stdout
