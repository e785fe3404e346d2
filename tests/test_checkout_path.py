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
