"""Start a server process, wait until it answers, stop it and everything it started.

The one lifecycle behind ``serve run`` (deployments/launcher.py), the load generator's
sweep servers (loadgen/study/launcher.py), Prometheus (dashboards/prometheus.py) and the
benchmarks' peers: output to a log file, readiness by polling, a graceful signal
first, then SIGKILL for the process and for whatever it started that outlived it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

LOG_TAIL_LINES = 40
POLL_FIRST_S = 0.2  # then doubling up to POLL_MAX_S: quick servers are found quickly
POLL_MAX_S = 2.0
HTTP_PROBE_TIMEOUT_S = 10.0


class LaunchError(RuntimeError):
    """A process did not come up, or did not go away cleanly."""


# Ray's default worker_niceness: proxy, router and engines run at it.
RAY_WORKER_NICENESS = 15


@dataclass(frozen=True)
class ChildSettings:
    """How a child starts: its own niceness, SIGINT restored, optionally its own session
    (whose scheduler group then gets the same niceness)."""

    niceness: int | None = None
    new_session: bool = False

    def __call__(self) -> None:
        # A process started in the background by a shell without job control (`nohup x &`,
        # CI runners) inherits SIGINT ignored, and its children would ignore our stop.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.new_session:
            os.setsid()  # a Ctrl-C meant for us reaches it only through stop_process
            if self.niceness is not None:
                set_session_niceness(self.niceness)
        if self.niceness is not None:
            current = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, 0, max(self.niceness, current))


def set_session_niceness(niceness: int) -> None:
    """Give this process's session, as one scheduler group, ``niceness``.

    With the kernel's autogroup on (``/proc/sys/kernel/sched_autogroup_enabled``, as on
    this box), the scheduler first shares the CPU between sessions as equals and only
    then between a session's processes by their niceness. A server in a session of its
    own at nice 0 therefore competes with its client's session as an equal however
    niced its processes are: a load generator at 1.6 req/s waited on the run queue up
    to 2.6 s a second, and its send lag reached p99 0.96-2.6 s (docs/DECISIONS.md).
    Without autogroup the file does not exist and niceness works per process anyway.
    """
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(niceness))


def start_process(
    command: list[str],
    log_path: Path,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    child: ChildSettings | None = None,
) -> subprocess.Popen[bytes]:
    """``command`` with stdout and stderr in ``log_path``; ``env`` replaces the environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=child or ChildSettings(),
        )


# What a router logs when an engine in its process failed every start it was given and
# never ran: its settings cannot work (vLLM's reason is in the line and the log above
# it), and Serve would restart the router, and the engine with it, for ever.
ENGINE_CANNOT_START = "splitserve: an engine cannot start"

# What Serve's controller logs to the `serve run` console when an application will not
# come up: its build failed, or its replicas kept failing to start
# (ray/serve/_private/application_state.py, _update_status). `serve run` of a config
# keeps running after either, so a launcher waiting for health would wait it out; so
# does a router whose engine can never start (ENGINE_CANNOT_START).
SERVE_DEPLOY_FAILED = (
    "Deploying app '",  # "... failed with exception:" (never "Deploying new app")
    "Runtime env setup for app '",
    "Unexpected error occurred while deploying application",
    "Failed to update the deployments",
    ENGINE_CANNOT_START,
)


def wait_until_ready(
    process: subprocess.Popen[bytes],
    ready: Callable[[], bool],
    log_path: Path,
    timeout_s: float,
    what: str,
    failure_markers: tuple[str, ...] = (),
) -> None:
    """Poll ``ready`` until it holds; raise LaunchError with the log's tail if the process
    exits first, its log gains a line with one of ``failure_markers``, or ``timeout_s``
    passes."""
    deadline = time.monotonic() + timeout_s
    pause = POLL_FIRST_S
    watch = LogWatch(log_path, failure_markers)
    while True:
        if process.poll() is not None:
            raise LaunchError(f"{what} exited with {process.returncode}:\n{tail(log_path)}")
        if (failure := watch.failure()) is not None:
            raise LaunchError(f"{what} failed: {failure}\n{tail(log_path)}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} not ready after {timeout_s:.0f}s:\n{tail(log_path)}")
        time.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)


class LogWatch:
    """Reads what a log gained since the last look, for a line that means failure."""

    def __init__(self, path: Path, markers: tuple[str, ...]) -> None:
        self._path = path
        self._markers = markers
        self._offset = 0
        self._partial = ""  # a line still being written

    def failure(self) -> str | None:
        """The first new complete line with a marker, if any."""
        if not self._markers:
            return None
        try:
            with self._path.open("rb") as log:
                log.seek(self._offset)
                gained = log.read()
        except OSError:
            return None
        self._offset += len(gained)
        lines = (self._partial + gained.decode(errors="replace")).split("\n")
        self._partial = lines.pop()
        return next((line.strip() for line in lines if any(m in line for m in self._markers)), None)


def http_ok(url: str, timeout_s: float = HTTP_PROBE_TIMEOUT_S) -> bool:
    """``GET url`` answered 200."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=timeout_s).status_code == 200
    return False


def stop_process(
    process: subprocess.Popen[Any],
    timeout_s: float,
    stop_signal: signal.Signals = signal.SIGINT,
) -> set[int]:
    """``stop_signal``, wait, SIGKILL; then SIGKILL whatever it started and left behind.
    Returns the pids that had to be killed after the wait, the process's own included
    (empty when all went quietly)."""
    family = descendants(process.pid)
    killed: set[int] = set()
    if process.poll() is None:
        process.send_signal(stop_signal)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            killed.add(process.pid)
    survivors = wait_gone(family, timeout_s)
    for pid, _ in survivors:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return killed | {pid for pid, _ in survivors}


@contextlib.contextmanager
def running_process(
    command: list[str],
    log_path: Path,
    ready: Callable[[], bool],
    *,
    what: str,
    ready_timeout_s: float,
    stop_timeout_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    child: ChildSettings | None = None,
    stop_signal: signal.Signals = signal.SIGINT,
    failure_markers: tuple[str, ...] = (),
) -> Iterator[subprocess.Popen[bytes]]:
    """The process for the length of a block, once ``ready``; stopped on the way out,
    and a LaunchError if anything it started had to be killed. ``failure_markers``:
    log lines that mean it will never be ready (see wait_until_ready)."""
    process = start_process(command, log_path, cwd=cwd, env=env, child=child)
    try:
        wait_until_ready(process, ready, log_path, ready_timeout_s, what, failure_markers)
        yield process
    finally:
        killed = stop_process(process, stop_timeout_s, stop_signal)
        if killed:
            raise LaunchError(
                f"{len(killed)} process(es) of {what} outlived the stop timeout and were"
                f" killed: {sorted(killed)}"
            )


# (pid, creation time): a process, immune to pid reuse.
ProcessId = tuple[int, float]


def descendants(root: int) -> set[ProcessId]:
    """Every process below ``root`` right now, however deep (zombies left out)."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return set()
    found = set()
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                found.add((child.pid, child.create_time()))
    return found


def command_lines() -> dict[int, str]:
    """Every process's command line, arguments joined by spaces."""
    lines = {}
    for process in psutil.process_iter(["cmdline"]):
        # psutil leaves a field it could not read as None (a process gone meanwhile).
        if (argv := process.info["cmdline"]) is not None:
            lines[process.pid] = " ".join(argv)
    return lines


def pids_with_env_entry(matches: Callable[[bytes], bool]) -> set[int]:
    """Processes with an environment entry (``NAME=value``, as bytes) that ``matches``:
    how a marker variable finds every process that inherited it, orphans included."""
    pids = set()
    for process in psutil.process_iter(["environ"]):
        environ = process.info["environ"]
        if environ and any(
            matches(f"{k}={v}".encode(errors="surrogateescape")) for k, v in environ.items()
        ):
            pids.add(process.pid)
    return pids


def wait_gone(processes: set[ProcessId], timeout_s: float) -> set[ProcessId]:
    """Those of ``processes`` still alive after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = {p for p in processes if _alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = {p for p in alive if _alive(p)}
    return alive


def _alive(process: ProcessId) -> bool:
    """The same process still runs (not a zombie nobody reaped, not a reused pid)."""
    pid, created = process
    try:
        found = psutil.Process(pid)
        return found.create_time() == created and found.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` of a log file, or nothing if it cannot be read."""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
