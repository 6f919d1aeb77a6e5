"""What a test reads of another process from /proc: whether it still runs, and the CPU
time it has spent."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command's name (which may hold spaces): state first."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie awaiting its reaper."""
    with contextlib.suppress(OSError):
        return _stat_fields(pid)[0] != "Z"
    return False


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (to a clock tick)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S
