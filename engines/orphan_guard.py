"""End a vLLM engine process when the Serve replica that started it is gone.

vLLM's EngineCore does not watch its parent: when Ray kills a replica actor
(``ray stop``, a crashed node agent, a killed driver) the EngineCore and its workers
live on as orphans holding their memory. Our vLLM plugin starts this guard in every
engine process whose environment asks for it (``SPLITSERVE_ORPHAN_GUARD=1``, set by
the application builder), so only engines we host are affected.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

ENV_FLAG = "SPLITSERVE_ORPHAN_GUARD"
POLL_INTERVAL_S = 1.0
# After SIGTERM, vLLM shuts its workers down; if that hangs, finish the job.
KILL_AFTER_S = 15.0

_started = False


def start_orphan_guard() -> bool:
    """Start the watcher thread once per process; True if this process is guarded."""
    global _started
    if _started or os.environ.get(ENV_FLAG) != "1":
        return _started
    if multiprocessing.parent_process() is None:
        return False  # the replica itself: Ray owns its lifetime
    _started = True
    parent = os.getppid()
    threading.Thread(
        target=_watch, args=(parent,), name="splitserve-orphan-guard", daemon=True
    ).start()
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(KILL_AFTER_S)
    os.kill(os.getpid(), signal.SIGKILL)
