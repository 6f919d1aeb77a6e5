"""What a test reads of another process: whether it still runs, and the CPU time it has
spent."""

from __future__ import annotations

import contextlib
import os

import psutil

# The kernel counts CPU time in clock ticks: the resolution of ``cpu_seconds``.
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie awaiting its reaper."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (to a clock tick)."""
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)
