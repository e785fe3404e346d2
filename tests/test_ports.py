"""Ports picked for services (pdmesh/processes.py `free_port`): with PDMESH_PORT_RANGE, from
that range only, never one another live process picked, never one something listens on."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from pdmesh import envs
from pdmesh.processes import free_port

CLAIM_FOUR = """
import sys
from pdmesh.processes import free_port
print(*[free_port() for _ in range(4)], flush=True)
sys.stdin.read()  # holds its claims until told to end
"""


def test_ports_come_from_the_range_and_no_two_live_processes_get_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A range of 10 below the suite's own (conftest: 20000-32000, which the meshes of the tests
    # running beside this one claim from) and below the ephemeral ports.
    lo = 15000 + (hash(__file__) % 400) * 10
    monkeypatch.setenv("PDMESH_PORT_RANGE", f"{lo}-{lo + 10}")
    with socket.socket() as listener:  # one port of the range taken without a claim
        listener.bind(("127.0.0.1", lo + 3))
        listener.listen()
        other = subprocess.Popen(
            [sys.executable, "-c", CLAIM_FOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert other.stdout is not None
            theirs = [int(p) for p in other.stdout.readline().split()]
            mine = [free_port() for _ in range(5)]
            with pytest.raises(RuntimeError, match="no port of PDMESH_PORT_RANGE"):
                free_port()
        finally:
            other.communicate("")
    assert len(set(theirs)) == 4 and len(set(mine)) == 5
    assert not set(theirs) & set(mine)
    assert lo + 3 not in theirs + mine
    assert set(theirs + mine) | {lo + 3} == set(range(lo, lo + 10))


def test_a_bad_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("20000", "30000-20000", "80-90", "a-b"):
        monkeypatch.setenv("PDMESH_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="PDMESH_PORT_RANGE must be LO-HI"):
            envs.port_range()
    monkeypatch.delenv("PDMESH_PORT_RANGE")
    assert envs.port_range() is None
    assert free_port() > 0
