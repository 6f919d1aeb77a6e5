"""Ports on the loopback interface for the servers and Ray clusters tests start."""

from __future__ import annotations

import socket

from deployments.local_nodes import forget_cluster, free_port

__all__ = ["forget_cluster", "free_port", "free_port_run"]


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
