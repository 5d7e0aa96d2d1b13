"""Host telemetry for the benchmarks' header and JSON: the date, the machine, the
versions, and how busy the machine was while a benchmark ran (a shared machine's noise)."""

from __future__ import annotations

import os
import platform
import re
import time
from typing import Any

import numpy as np

__all__ = ["environment", "CpuMeter", "loadavg", "peak_mib"]


def environment(library: str | None = None) -> dict[str, Any]:
    """Date, machine and versions, for the table's header and the JSON."""
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        if m:
            env["cpu"] = m.group(1).strip()
        flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        if flags:
            have = set(flags.group(1).split())
            env["simd"] = " ".join(f for f in ("avx2", "avx512f") if f in have)
    except OSError:
        pass
    for mod in ("onnxruntime", "randomgen"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    if library is None:
        try:
            from .. import get_library_path

            library = get_library_path()
        except FileNotFoundError:
            library = None
    env["library"] = library
    return env


class CpuMeter:
    """CPU time used by other processes while a benchmark runs, in cores on average (from
    ``/proc/stat`` minus this process's own time): the noise figure of a shared machine.
    ``None`` where ``/proc/stat`` is not readable."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / tick
        own = sum(os.times()[:4])
        return time.monotonic(), busy, own

    def others(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[0] <= self._start[0]:
            return None
        wall = end[0] - self._start[0]
        return max(0.0, (end[1] - self._start[1]) - (end[2] - self._start[2])) / wall


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, or "n/a"."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def peak_mib() -> float:
    """This process's peak resident memory, MiB: Linux's ``VmHWM`` (the high-water mark of
    this process's own address space since its exec), else ``ru_maxrss``. ``ru_maxrss``
    alone would not do: Linux carries the parent's peak over into a child's through fork
    and exec, so every child would report at least the benchmark parent's peak."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
