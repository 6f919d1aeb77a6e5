"""Socket folders that die with their process: vLLM's IPC sockets and the KV-event
relay's live in a folder named after the engine host's process, removed when it stops,
or by the next host once that process is gone (engines/socket_folders.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engines.kv_events import KVEventRelay
from engines.socket_folders import FOLDER_PREFIX, owned_folder, remove_orphaned_folders


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_killed_owners_folder_is_removed_and_live_ones_stay(tmp_path: Path) -> None:
    orphaned = tmp_path / f"{FOLDER_PREFIX}{_dead_pid()}-vllm-abc"
    live = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-vllm-def"
    unnamed = tmp_path / f"{FOLDER_PREFIX}nopid"
    for folder in (orphaned, live, unnamed):
        folder.mkdir()
        (folder / "0001166f-09eb-4220-a446-563b18ea202d").touch()
    assert remove_orphaned_folders(tmp_path) == [orphaned]
    assert not orphaned.exists()
    assert live.exists() and unnamed.exists()


def test_a_folder_is_named_after_its_process_and_purpose() -> None:
    folder = owned_folder("vllm")
    try:
        assert folder.name.startswith(f"{FOLDER_PREFIX}{os.getpid()}-vllm-")
        assert folder.is_dir()
    finally:
        folder.rmdir()


def test_a_relay_keeps_its_socket_in_its_own_folder_and_removes_it_on_stop() -> None:
    relay = KVEventRelay("engine-0", deliver=lambda update: None)
    folder = Path(relay.endpoint.removeprefix("ipc://")).parent
    assert folder.name.startswith(f"{FOLDER_PREFIX}{os.getpid()}-kv-events-")
    assert folder.is_dir()
    relay.stop()
    assert not folder.exists()
