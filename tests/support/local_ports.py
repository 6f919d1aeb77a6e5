"""Ports on the loopback interface for the servers and Ray clusters tests start."""

from __future__ import annotations

import socket

from deployments.local_nodes import forget_cluster, free_port

__all__ = ["SESSION_INGRESS_PORTS", "forget_cluster", "free_port", "free_port_run"]

# Direct-ingress ports the session's cluster gives routers from DEFAULT_PORT on
# (conftest.py): enough for the applications of several routers, which then share that
# cluster with the others instead of starting one of their own.
SESSION_INGRESS_PORTS = 3


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
