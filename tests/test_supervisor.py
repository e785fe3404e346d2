"""The supervisor's restart back-off, with real child processes: it doubles while a child keeps
exiting at once, and goes back to the shortest delay once a child had stayed up for
`reset_after_s` before it exited (a worker a rare bad request takes down is back at once, not
after the longest delay)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pdmesh.supervisor import Backoff, ProcessSpec, spawn, stop_all, supervise

pytestmark = pytest.mark.timeout(60)

# Run k (1, 2, ...) of the child: runs 1-3 exit at once, run 4 stays up 1.5 s then exits, later
# runs stay up.
CHILD = """
import sys, time
from pathlib import Path
runs = Path(sys.argv[1])
with runs.open("a") as f:
    f.write("x")
k = len(runs.read_text())
if k <= 3:
    sys.exit(1)
time.sleep(1.5 if k == 4 else 60)
sys.exit(1)
"""


def test_backoff_doubles_on_quick_exits_and_resets_after_a_long_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    backoff = Backoff(base_s=0.2, max_s=1.0, reset_after_s=1.0)
    spec = ProcessSpec("child", [sys.executable, "-c", CHILD, str(runs)], "-", backoff=backoff)
    child = spawn(spec)
    delays: list[float] = []  # each restart's scheduled delay, in order
    try:
        deadline = time.monotonic() + 30
        while len(delays) < 4 and time.monotonic() < deadline:
            scheduled = child.restart_at is not None
            assert supervise([child])
            if not scheduled and child.restart_at is not None:
                delays.append(child.last_delay_s)
            time.sleep(0.02)
        # After the 4th exit the child is restarted once more, and then stays up.
        while child.restart_at is not None and time.monotonic() < deadline:
            supervise([child])
            time.sleep(0.02)
        time.sleep(0.3)
        assert child.proc.poll() is None
    finally:
        stop_all([child])
    assert delays == [0.2, 0.4, 0.8, 0.2], delays  # the last: after 1.5 s up, back to the base
    assert len(runs.read_text()) == 5
    assert child.restarts == 4


def test_backoff_caps_at_its_maximum() -> None:
    backoff = Backoff(base_s=2, max_s=30, reset_after_s=60)
    assert [backoff.delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0)
