"""Start and stop a server for the sweep: ``python -m deployments.serve <mode>`` by default.

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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
HEALTH_POLL_FIRST_S = 0.2  # then doubling up to HEALTH_POLL_S: quick servers start quickly
HEALTH_POLL_S = 2.0
HEALTH_TIMEOUT_S = 10.0
DEFAULT_READY_TIMEOUT_S = 600.0
DEFAULT_STOP_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 30


class LaunchError(RuntimeError):
    """The server did not come up, or did not go away cleanly."""


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
    """A ``--launch-command`` such as ``my-launcher --mode {mode} --port {port}``."""
    return shlex.split(template.format(**fields))


def is_healthy(base_url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{base_url}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
    return False


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
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            # Its own session: a Ctrl-C meant for us reaches it only through our stop().
            start_new_session=True,
        )
    try:
        _wait_healthy(process, base_url, log_path, ready_timeout_s)
        yield LaunchedServer(base_url, command, log_path, process.pid)
    finally:
        leftovers = stop_process_tree(process, stop_timeout_s)
        if leftovers:
            raise LaunchError(
                f"{len(leftovers)} process(es) of {shlex.join(command)} outlived the stop"
                f" timeout and were killed: {sorted(leftovers)}"
            )


def _wait_healthy(
    process: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    pause = HEALTH_POLL_FIRST_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"the server exited with {process.returncode}:\n{tail(log_path)}")
        if is_healthy(base_url):
            return
        time.sleep(pause)
        pause = min(pause * 2, HEALTH_POLL_S)
    raise LaunchError(f"{base_url}/health not ready after {timeout_s:.0f}s:\n{tail(log_path)}")


def stop_process_tree(process: subprocess.Popen[bytes], timeout_s: float) -> set[int]:
    """SIGINT, wait, then SIGKILL whatever the process started and left behind."""
    family = descendants(process.pid)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    survivors = _wait_gone(family, timeout_s)
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {pid for pid, _ in survivors}


ProcessId = tuple[int, int]  # (pid, start time in clock ticks): immune to pid reuse


def descendants(root: int) -> set[ProcessId]:
    """Every process below ``root`` right now."""
    children: dict[int, list[ProcessId]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parent, started = stat
            children.setdefault(parent, []).append((int(entry.name), started))
    found: set[ProcessId] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child[0])
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) from /proc/PID/stat; None if it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def _alive(process: ProcessId) -> bool:
    stat = _stat(process[0])
    return stat is not None and stat[1] == process[1]


def _wait_gone(processes: set[ProcessId], timeout_s: float) -> set[ProcessId]:
    deadline = time.monotonic() + timeout_s
    alive = {p for p in processes if _alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = {p for p in alive if _alive(p)}
    return alive


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
