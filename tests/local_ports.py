"""Ports on the loopback interface for the servers and Ray clusters tests start."""

from __future__ import annotations

import contextlib
import socket
import tempfile
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forget_cluster(port: int) -> None:
    """Forget a stopped Ray cluster whose GCS listened on ``port``.

    `ray start` records its address for later clients; `serve run` would otherwise try to
    join the stopped cluster and hang. `ray stop` deletes the file; we do too.
    """
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if current.read_text().strip().endswith(f":{port}"):
            current.unlink()
