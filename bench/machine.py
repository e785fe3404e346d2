"""What the benchmarks record about the machine: CPU model, per-process and machine CPU time
(Linux /proc), so a figure says what it ran on and whether anything else was running."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def device_name() -> str:
    """The CPU model (e.g. 'Intel(R) Xeon(R) Processor'), or the architecture if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds spent by the whole machine, all cores, to spot other load."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
