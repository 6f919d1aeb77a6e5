"""Several Ray nodes on this one machine, each with its own raylet and object store.

The two-node tests and benches run on it: a head and ``ray start --address`` workers,
each labelled ``LABEL=<role>`` so that a YAML's ``placement.node_labels`` can pick it,
and each given the environment of ``cluster_env`` (Serve's direct ingress). Every
process a node starts carries ``NODE_MARKER=<marker>:<role>`` in its environment, so
that one node's processes can be found (and killed) apart from the other's and from any
other cluster on the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deployments.launcher import cluster_env
from splitserve.processes import (
    LaunchError,
    ProcessId,
    descendants,
    pids_with_env_entry,
    wait_gone,
)

NODE_MARKER = "SPLITSERVE_LOCAL_NODE"
LABEL = "splitserve-pool"
OBJECT_STORE_BYTES = 300 * 1024 * 1024
STOP_WAITS_S = ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0))


@dataclass(frozen=True)
class NodeSpec:
    role: str  # the node's LABEL value; the first node given is the head
    num_cpus: int = 2
    resources: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalCluster:
    address: str
    dashboard_url: str
    metrics_ports: dict[str, int]  # node role -> its metrics export port
    marker: str

    def pids(self, role: str | None = None) -> set[int]:
        """The live processes of one node (``role``), or of every node."""
        return marked_pids(self.marker, role)


@contextlib.contextmanager
def local_nodes(
    nodes: Sequence[NodeSpec],
    *,
    object_store_bytes: int = OBJECT_STORE_BYTES,
    health_check_period_ms: int | None = None,
) -> Iterator[LocalCluster]:
    """Start ``nodes`` (the first one is the head) until the block ends, then stop
    every process they started, whatever state the block left them in."""
    marker = uuid.uuid4().hex[:12]
    port, dashboard_port = free_port(), free_port()
    metrics_ports = {node.role: free_port() for node in nodes}
    # `ray start` turns token authentication on where it finds a token file (which a
    # local `ray.init()` writes), while a client with RAY_AUTH_MODE unset stays off:
    # the nodes take the caller's mode, and off where the caller has none.
    extra_env = {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }
    if health_check_period_ms is not None:
        extra_env["RAY_health_check_period_ms"] = str(health_check_period_ms)
    head = [
        "--head", f"--port={port}", "--include-dashboard=true",
        f"--dashboard-port={dashboard_port}",
    ]  # fmt: skip
    try:
        for index, node in enumerate(nodes):
            where = head if index == 0 else [f"--address=127.0.0.1:{port}"]
            args = [*where, *_node_args(node, object_store_bytes, metrics_ports[node.role])]
            _start_node(args, f"{marker}:{node.role}", extra_env)
        yield LocalCluster(
            f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}", metrics_ports, marker
        )
    finally:
        _stop(marker)
        forget_cluster(port)


def marked_pids(marker: str, role: str | None = None) -> set[int]:
    """Processes of the cluster ``marker`` (of its node ``role`` only, if given)."""
    node = f"{NODE_MARKER}={marker}:".encode()
    if role is None:
        return pids_with_env_entry(lambda entry: entry.startswith(node))
    wanted = node + role.encode()
    return pids_with_env_entry(lambda entry: entry == wanted)


def _node_args(node: NodeSpec, object_store_bytes: int, metrics_port: int) -> list[str]:
    args = [f"--num-cpus={node.num_cpus}", f"--labels={LABEL}={node.role}"]
    if node.resources:
        resources = ", ".join(f'"{name}": {amount}' for name, amount in node.resources.items())
        args.append(f"--resources={{{resources}}}")
    return [
        *args, f"--object-store-memory={object_store_bytes}",
        f"--metrics-export-port={metrics_port}", "--disable-usage-stats",
    ]  # fmt: skip


def _start_node(args: list[str], marker: str, extra_env: dict[str, str]) -> None:
    env = cluster_env() | dict(os.environ, **extra_env)
    env[NODE_MARKER] = marker
    ray = str(Path(sys.executable).with_name("ray"))
    started = subprocess.run([ray, "start", *args], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        raise LaunchError(f"`ray start` ({marker}) failed:\n{started.stderr[-3000:]}")


def _stop(marker: str) -> None:
    """Every process of the nodes, and every process below them: Ray's dashboard and
    runtime-env agents write their titles over their environment, marker included, and
    outlive a killed raylet by minutes, so they are found as children before any dies."""
    below: set[ProcessId] = set()
    for pid in marked_pids(marker):
        below |= descendants(pid)

    def running() -> set[int]:
        return marked_pids(marker) | {pid for pid, _ in wait_gone(below, 0)}

    for signum, wait_s in STOP_WAITS_S:
        for pid in running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        deadline = time.monotonic() + wait_s
        while running() and time.monotonic() < deadline:
            time.sleep(0.5)


def free_port() -> int:
    """A loopback port nobody listens on now."""
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
