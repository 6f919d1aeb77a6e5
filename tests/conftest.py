"""Shared fixtures: one real Ray cluster for the session, applications started with ``serve run``.

The session ends by stopping Ray and checking that no Ray or vLLM process it started
is left; leftovers are killed and reported as an error, also when tests failed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployments.launcher import engine_pids

RAY_PROCESS_MARKERS = (b"raylet", b"gcs_server", b"ray::", b"dashboard/agent", b"default_worker")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if any(marker in cmdline for marker in RAY_PROCESS_MARKERS):
                    pids.add(int(entry.name))
    return pids


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head for the whole session, small and quiet: the engines get the cores."""
    before = _ray_pids() | engine_pids()
    port = _free_port()
    # `ray start` turns token authentication on; every client of this session
    # (`serve run` included, through os.environ) must then present the token too.
    os.environ["RAY_AUTH_MODE"] = "token"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    subprocess.run(
        [
            _ray_cli(),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        subprocess.run([_ray_cli(), "stop", "--force"], env=env, capture_output=True)
        leftovers = _wait_gone((_ray_pids() | engine_pids()) - before, timeout_s=30)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not leftovers, f"processes outlived the test session (killed): {sorted(leftovers)}"


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.5)
        pids = pids & (_ray_pids() | engine_pids())
    return pids


@pytest.fixture(scope="session")
def serve_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")
