"""Engine processes run a little below the router in CPU priority (CPU engines only).

On a machine whose cores the engines fill (their OpenMP threads spin while they
compute), a router at the same niceness gets a third of a core: a burst's refusals
then waited 170-230 ms inside the router for CPU, not for anything of ours
(bench/overload.py, docs/DECISIONS.md). The router needs little CPU and needs it at
once; the engines take all that is left either way.
"""

from __future__ import annotations

import multiprocessing
import os

ENV_VAR = "SPLITSERVE_ENGINE_NICENESS"


def lower_engine_priority() -> int | None:
    """In an engine's own processes (vLLM's children of the router), raise the niceness
    to ``SPLITSERVE_ENGINE_NICENESS`` if it is lower; the new niceness, or None."""
    wanted = os.environ.get(ENV_VAR)
    if wanted is None or multiprocessing.parent_process() is None:
        return None  # not asked, or the hosting process itself (the router)
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if int(wanted) > current:
        os.setpriority(os.PRIO_PROCESS, 0, int(wanted))
    return os.getpriority(os.PRIO_PROCESS, 0)
