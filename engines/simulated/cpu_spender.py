"""A simulated engine's steps spent as CPU time, for ``engine.spend: cpu``.

A CPU engine's step is work on its cores: where the router, the client or another engine
share those cores, the step takes longer in the wall clock. A simulated engine that
sleeps takes no CPU, so on a box where everything shares two cores it runs as if it had
a core of its own. With ``spend: cpu`` each step's time is spent computing in a child
process bound to the engine's cores (its ``VLLM_CPU_OMP_THREADS_BIND``), as vLLM's CPU
worker computes in a process of its own, bound the same way, beside the host's event
loop: the scheduler of the OS then shares the cores between it and everything else, as
it shares them with a real CPU engine. vLLM's engine core (scheduling, messages, not
bound) has no counterpart here (bench/cpu_share.py shows what it takes). For checking a
profile of a CPU engine on the box it was fitted on; a GPU's time is spent sleeping
(``spend: wall``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

# How the child's command line begins, so that a process list can tell it apart.
SPENDER_TAG = "# splitserve: a simulated engine's CPU spender"
# The child: read a CPU time in seconds per line, compute until this thread has spent
# it, answer one byte. It ends when its input closes (its engine's process has gone).
_CHILD = (
    SPENDER_TAG
    + """
import os, sys, time
cores = sys.argv[1]
if cores:
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    end = time.thread_time() + float(line)
    while time.thread_time() < end:
        pass
    out.write(b"."); out.flush()
"""
)


def bound_cores(bind: str | None) -> set[int] | None:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND`` value's first rank (``0``, ``0-3``,
    ``0,2``; ranks are separated by ``|``); None where it binds none (unset, ``all``,
    ``auto``, ``nobind``)."""
    if not bind or bind in ("all", "auto", "nobind"):
        return None
    cores: set[int] = set()
    for part in bind.split("|")[0].split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


class CpuSpender:
    """Spends CPU time in a child process bound to ``cores`` (any core where None)."""

    def __init__(self, cores: set[int] | None) -> None:
        self._cores = cores
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def spend(self, seconds: float) -> None:
        """Return once the child has computed for ``seconds`` of its own CPU time."""
        if seconds <= 0:
            return
        async with self._lock:  # one step at a time, as an engine core computes
            child = await self._started()
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(f"{seconds!r}\n".encode())
            await child.stdin.drain()
            if not await child.stdout.read(1):
                raise RuntimeError(f"the CPU spender (pid {child.pid}) exited")

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is None:
            cores = ",".join(str(core) for core in sorted(self._cores or ()))
            self._child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _CHILD,
                cores,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return self._child

    def close(self) -> None:
        """End the child: its input closes, and it is killed should it be computing."""
        child, self._child = self._child, None
        if child is None:
            return
        if child.stdin is not None:
            child.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            child.kill()
