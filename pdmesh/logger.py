"""One logger setup for every pdmesh process."""

from __future__ import annotations

import logging
import sys

from pdmesh import envs

_CONFIGURED = False


def get_logger(name: str) -> logging.Logger:
    global _CONFIGURED
    if not _CONFIGURED:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S")
        )
        root = logging.getLogger("pdmesh")
        root.addHandler(handler)
        root.setLevel(envs.log_level())
        root.propagate = False
        _CONFIGURED = True
    return logging.getLogger(name if name.startswith("pdmesh") else f"pdmesh.{name}")
