"""A real Prometheus for tests: its HTTP query API, polled until a value holds."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[str]

    def query(self, expr: str) -> dict:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, want: float, timeout_s: float = 30) -> float | None:
        return self._poll(lambda: self.value(expr), lambda v: v == want, timeout_s)

    def wait_equal(self, a: str, b: str, timeout_s: float = 30) -> tuple[float | None, ...]:
        """`a` and `b` once they agree; each target is scraped on its own clock."""
        return self._poll(
            lambda: (self.value(a), self.value(b)),
            lambda v: v[0] is not None and v[0] == v[1],
            timeout_s,
        )

    def wait_ready(self, n_targets: int, timeout_s: float = 60) -> None:
        """Until every target is scraped and up (raises if Prometheus exits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
                )
            try:
                if self.value("sum(up)") == n_targets and self.value("count(up)") == n_targets:
                    return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(
            f"Prometheus did not scrape all {n_targets} targets within {timeout_s} s"
        )

    @staticmethod
    def _poll(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        value = read()
        while not done(value) and time.monotonic() < deadline:
            time.sleep(0.25)
            value = read()
        return value


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail(
            "Prometheus is not installed: `make test` installs Debian's package "
            "(apt-get install prometheus); this test never skips."
        )
    return path
