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


def free_port_run(length: int) -> int:
    """The first of ``length`` consecutive ports nobody listens on or holds (several
    router replicas under direct ingress take consecutive ports)."""
    for base in range(18_000, 20_000, 10):
        sockets = []
        try:
            for port in range(base, base + length):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports")


def forget_cluster(port: int) -> None:
    """Forget a stopped Ray cluster whose GCS listened on ``port``.

    `ray start` records its address for later clients; `serve run` would otherwise try to
    join the stopped cluster and hang. `ray stop` deletes the file; we do too.
    """
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if current.read_text().strip().endswith(f":{port}"):
            current.unlink()
