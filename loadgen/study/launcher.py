"""Start and stop a server for the sweep: ``python -m deployments.serve <shape>`` by default.

The load generator is an external client: it runs the same command a person would,
as a subprocess, waits until ``GET /health`` answers 200, and stops it with SIGINT
(``serve run`` then shuts the application and its engines down). Every process the
command started is noted before stopping; any that outlives the stop timeout is
killed, and only those: other people's servers on the machine are not touched.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from splitserve.processes import (
    RAY_WORKER_NICENESS,
    SERVE_DEPLOY_FAILED,
    ChildSettings,
    LaunchError,
    http_ok,
    running_process,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LaunchedServer:
    base_url: str
    command: list[str]
    log_path: Path
    pid: int


def serve_run_command(config_path: Path, port: int) -> list[str]:
    """``serve run CONFIG`` as ``python -m deployments.serve`` runs it: the router on
    ``port`` through Serve's direct ingress."""
    return [sys.executable, "-m", "deployments.serve", str(config_path), "--port", str(port)]


def command_from_template(template: str, **fields: object) -> list[str]:
    """A ``--launch-command`` such as ``my-launcher --shape {shape} --port {port}``."""
    return shlex.split(template.format(**fields))


def is_healthy(base_url: str) -> bool:
    return http_ok(f"{base_url}/health")


@contextlib.contextmanager
def launched_server(
    command: list[str],
    base_url: str,
    log_path: Path,
    *,
    cwd: Path = REPO_ROOT,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S,
) -> Iterator[LaunchedServer]:
    """Run ``command`` until the block ends; yield once ``base_url/health`` is 200."""
    if is_healthy(base_url):
        raise LaunchError(
            f"something already serves {base_url}; stop it first, or measure it with --urls"
        )
    with running_process(
        command,
        log_path,
        lambda: is_healthy(base_url),
        what=shlex.join(command),
        ready_timeout_s=ready_timeout_s,
        stop_timeout_s=stop_timeout_s,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        # Niced as Ray's workers are, and so is its session's scheduler group: the
        # client measuring it must not wait behind it for the CPU.
        child=ChildSettings(niceness=RAY_WORKER_NICENESS, new_session=True),
        failure_markers=SERVE_DEPLOY_FAILED,
    ) as process:
        yield LaunchedServer(base_url, command, log_path, process.pid)
