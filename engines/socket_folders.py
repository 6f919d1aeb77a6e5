"""Folders for the UNIX sockets of one engine host's process, removed with it.

vLLM binds its ZMQ IPC sockets (front end to engine core, engine core to workers) as
files named by a UUID in ``VLLM_RPC_BASE_PATH``, the temporary directory by default,
and a process stopped by a signal, as its workers are, leaves them there: thousands a
day on a box that starts engines all day. Each engine host therefore gives its engine,
and the KV-event relay, a folder of its own, named after the host's process, and
removes it when the engine stops. A folder whose process died without removing it is
removed by the next host that starts on the node (or by the test session's end).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

FOLDER_PREFIX = "splitserve-sockets-"
# Where vLLM puts its IPC sockets (vllm.envs), read as its processes start.
VLLM_IPC_ENV = "VLLM_RPC_BASE_PATH"


def owned_folder(purpose: str) -> Path:
    """A new folder that this process owns (``<prefix><pid>-<purpose>-<random>``), after
    removing those of processes that are gone."""
    remove_orphaned_folders(Path(tempfile.gettempdir()))
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-{purpose}-"))


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def remove_orphaned_folders(parent: Path) -> list[Path]:
    """Remove the socket folders under ``parent`` whose owning process is gone."""
    removed = []
    for folder in parent.glob(f"{FOLDER_PREFIX}*"):
        owner = _owner_pid(folder.name)
        if owner is None or _alive(owner):
            continue
        remove_folder(folder)
        removed.append(folder)
    return removed


def _owner_pid(folder_name: str) -> int | None:
    pid, _, _ = folder_name.removeprefix(FOLDER_PREFIX).partition("-")
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
