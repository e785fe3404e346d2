"""Processes started as forks of a warm interpreter (pdmesh/warm_start.py) behave as `python -m`
would have started them: the same output, arguments, directory, environment and exit codes;
signals and waits as with `subprocess.Popen`; gone with the process that started them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdmesh.warm_start import WarmProcess, start_module

pytestmark = pytest.mark.timeout(180)

PROBE = """
import json, os, sys
warm = "torch" in sys.modules  # imported by the zygote, not by this module
threads = sys.modules["torch"].get_num_threads() if warm else None
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("PDMESH_PROBE"),
                  "warm": warm, "main": __name__, "ppid": os.getppid(), "threads": threads}),
      flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "sleep" in sys.argv:
    import time; time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "probe_main.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)  # `python -m probe_main` finds it in the working directory
    return tmp_path


def _report(text: str) -> dict[str, object]:
    return json.loads(text.strip().splitlines()[0])


def test_a_warm_child_is_what_python_dash_m_starts(probe_dir: Path, capfd) -> None:
    env = {**os.environ, "PDMESH_PROBE": "set"}
    proc = start_module("probe_main", ["3", "x y"], env)
    assert isinstance(proc, WarmProcess)
    assert proc.wait(60) == 3 and proc.returncode == 3
    warm = capfd.readouterr()
    cold = subprocess.run(
        [sys.executable, "-m", "probe_main", "3", "x y"], env=env, capture_output=True, text=True
    )
    got, want = _report(warm.out), _report(cold.stdout)
    assert got.pop("warm") is True and want.pop("warm") is False
    assert got.pop("ppid") != os.getpid()  # the zygote's child, not this process's
    want.pop("ppid")
    assert got.pop("threads") is not None and want.pop("threads") is None
    assert got == want == {"argv": ["3", "x y"], "cwd": str(probe_dir), "env": "set",
                           "main": "__main__"}  # fmt: skip
    assert warm.err.strip() == cold.stderr.strip() == "to stderr"
    assert cold.returncode == 3


def test_quiet_children_write_nothing_and_failures_keep_their_codes(probe_dir, capfd) -> None:
    assert start_module("probe_main", ["0"], quiet=True).wait(60) == 0
    assert capfd.readouterr().out == ""
    assert start_module("no_such_module_here", []).wait(60) == 1
    assert "No module named no_such_module_here" in capfd.readouterr().err


def test_signals_waits_and_timeouts_answer_as_popen_does(probe_dir: Path) -> None:
    procs = [start_module("probe_main", ["0", "sleep"], quiet=True) for _ in range(2)]
    assert all(isinstance(p, WarmProcess) for p in procs)
    with pytest.raises(subprocess.TimeoutExpired):
        procs[0].wait(0.3)
    assert procs[0].poll() is None
    procs[0].terminate()
    procs[1].kill()
    assert procs[0].wait(30) == -signal.SIGTERM
    assert procs[1].wait(30) == -signal.SIGKILL
    procs[1].kill()  # already gone: nothing to signal, no error


def test_an_environment_read_at_import_gets_a_zygote_of_its_own(probe_dir: Path) -> None:
    """OMP_NUM_THREADS is read when torch loads its OpenMP runtime, in the zygote: a child that
    sets it comes from a zygote started with it; a PDMESH_ variable changes no zygote. A third
    environment ends the least recently used zygote that has no child running (MAX_ZYGOTES is
    2). In a process of its own: this one may hold zygotes of other environments already."""
    driver = (
        "import os, sys\n"
        "from pdmesh.warm_start import MAX_ZYGOTES, start_module\n"
        "assert MAX_ZYGOTES == 2\n"
        "for extra in ({'PDMESH_PROBE': 'a'}, {'OMP_NUM_THREADS': '1'}, {'PDMESH_PROBE': 'b'},\n"
        "              {'OMP_NUM_THREADS': '2'}):\n"
        "    assert start_module('probe_main', ['0'], {**os.environ, **extra}).wait(60) == 0\n"
        "import json, pathlib, time\n"
        "time.sleep(1)  # for an ended zygote to have exited\n"
        "tasks = pathlib.Path('/proc/self/task').glob('*/children')\n"
        "print(json.dumps(sorted(int(c) for t in tasks for c in t.read_text().split())))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    *reports, zygotes = (json.loads(line) for line in out.splitlines())
    plain, one, again, two = reports
    assert plain["warm"] and one["warm"] and again["warm"] and two["warm"]
    assert one["threads"] == 1 < plain["threads"] and two["threads"] == 2
    assert one["ppid"] != plain["ppid"] == again["ppid"]
    assert (plain["env"], again["env"]) == ("a", "b")
    # The zygote of OMP_NUM_THREADS=1, used least recently, made room for the fourth start's.
    assert zygotes == sorted([plain["ppid"], two["ppid"]])


def test_a_process_without_a_stdout_starts_a_new_interpreter(probe_dir: Path) -> None:
    """Its zygote's child would have nowhere to write; a new interpreter inherits the closed
    descriptor as `subprocess.Popen` gives it, and the zygote stays in use."""
    driver = (
        "import os, sys\n"
        "from pdmesh.warm_start import start_module\n"
        "first = start_module('probe_main', ['0'], quiet=True)\n"
        "os.close(1)\n"
        "second = start_module('probe_main', ['0'])\n"
        "os.dup2(2, 1)\n"
        "third = start_module('probe_main', ['0'], quiet=True)\n"
        "codes = [p.wait(60) for p in (first, second, third)]\n"
        "print([type(p).__name__ for p in (first, second, third)], codes, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    kinds = "['WarmProcess', 'Popen', 'WarmProcess']"
    assert done.stderr.strip().splitlines()[-1] == f"{kinds} [0, 0, 0]"


def test_children_die_with_the_process_that_started_them(probe_dir: Path) -> None:
    """SIGKILL the starter: its zygote and the zygote's children go with it; a new zygote
    serves the next start of a process whose zygote died."""
    starter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pdmesh.warm_start import start_module\n"
            "p = start_module('probe_main', ['0', 'sleep'], quiet=True)\n"
            "print(type(p).__name__, p.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert starter.stdout is not None
    kind, pid = starter.stdout.readline().split()
    assert kind == "WarmProcess"
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 20
    while _alive(int(pid)):
        assert time.monotonic() < deadline, "the warm child outlived its starter"
        time.sleep(0.1)


def test_a_dead_zygote_ends_its_children_and_is_started_again(probe_dir, capfd) -> None:
    child = start_module("probe_main", ["0", "sleep"])
    assert isinstance(child, WarmProcess)
    for _ in range(100):  # its report names its parent: the zygote
        if out := capfd.readouterr().out:
            break
        time.sleep(0.1)
    zygote = int(_report(out)["ppid"])  # type: ignore[call-overload]
    os.kill(zygote, signal.SIGKILL)
    assert child.wait(30) == -signal.SIGTERM  # it died with its zygote
    again = start_module("probe_main", ["5"])
    assert isinstance(again, WarmProcess)
    assert again.wait(60) == 5
    assert _report(capfd.readouterr().out)["ppid"] != zygote


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still takes signals: it has exited.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
