"""engine.spend: cpu's child process: it spends CPU time, not wall time, on the cores it
is bound to, and leaves with its engine."""

from __future__ import annotations

import asyncio
import os

import pytest

from engines.simulated.cpu_spender import CpuSpender, bound_cores
from tests.support.processes import TICKS_PER_S, alive, cpu_seconds


@pytest.mark.parametrize(
    ("bind", "cores"),
    [("0", {0}), ("0-2,5", {0, 1, 2, 5}), ("1|0", {1}), ("auto", None), ("", None), (None, None)],
)
def test_bound_cores_reads_vllms_bind_for_the_first_rank(
    bind: str | None, cores: set[int] | None
) -> None:
    assert bound_cores(bind) == cores


async def test_a_spend_is_cpu_time_of_a_child_bound_to_the_cores() -> None:
    spender = CpuSpender({0})
    try:
        await spender.spend(0.01)  # starts the child
        pid = spender.pid
        assert pid is not None and pid != os.getpid()
        assert os.sched_getaffinity(pid) == {0}
        before = cpu_seconds(pid)
        for _ in range(10):
            await spender.spend(0.02)
        spent = cpu_seconds(pid) - before
    finally:
        spender.close()
    # 0.2 s asked for, read to a clock tick at each end.
    assert spent >= 0.2 - 2 / TICKS_PER_S


async def test_closing_ends_the_child() -> None:
    spender = CpuSpender(None)
    await spender.spend(0.001)
    pid = spender.pid
    assert pid is not None
    spender.close()
    for _ in range(100):
        if not alive(pid):
            break
        await asyncio.sleep(0.02)
    assert not alive(pid)
    await spender.spend(0)  # nothing to spend needs no child
    assert spender.pid is None
