"""Start and stop a splitserve application exactly as a user does: ``serve run FILE.yaml``.

Used by the demo, the tests and the benchmarks, so they all exercise the real entry
point. Stopping is graceful first (SIGINT makes ``serve run`` shut the application
down, which shuts every engine down) and then checked: no vLLM engine process that
the application started may outlive it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
ENGINE_PROCESS_MARKERS = ("VLLM::", "EngineCore")
APP_NAME = "splitserve"  # the application name in every YAML under deployments/
# Environment for a Ray cluster that serves us; it only takes effect where the cluster
# starts (serve_run without an address here, `ray start` in the tests), since Ray's
# daemons and workers inherit it from there. Serve's proxy then calls the ingress
# replica over Serve's gRPC transport instead of Ray actor calls and object-ref
# streams, which cut the proxy's CPU per streamed token on two cores
# (bench/overhead.py, docs/DECISIONS.md).
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


class LaunchError(RuntimeError):
    """The application did not come up, or did not go away cleanly."""


@dataclass(frozen=True)
class RunningApp:
    base_url: str
    config_path: Path
    log_path: Path


def config_path(name_or_path: str) -> Path:
    """``dp`` names ``deployments/dp.yaml``; anything with a slash or suffix is a path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) > 1:
        return candidate.resolve()
    return DEPLOYMENTS_DIR / f"{name_or_path}.yaml"


def engine_pids() -> set[int]:
    """PIDs of vLLM engine-core and worker processes on this machine."""
    return {pid for pid, cmdline in _processes().items() if _is_engine(cmdline)}


def app_engine_pids(app_name: str = APP_NAME) -> set[int]:
    """Engine processes started by the Serve replicas of one application."""
    replica_prefix = f"ray::ServeReplica:{app_name}:"
    return _engines_below(lambda pid, cmdline: cmdline.startswith(replica_prefix))


def descendant_engine_pids(root: int) -> set[int]:
    """Engine processes below one process (a server we started), however deep."""
    return _engines_below(lambda pid, cmdline: pid == root)


def _engines_below(is_owner: Callable[[int, str], bool]) -> set[int]:
    processes = _processes()
    parents = _parents()
    owned = set()
    for pid, cmdline in processes.items():
        if not _is_engine(cmdline):
            continue
        ancestor = parents.get(pid, 0)
        while ancestor > 1:
            if is_owner(ancestor, processes.get(ancestor, "")):
                owned.add(pid)
                break
            ancestor = parents.get(ancestor, 0)
    return owned


def _is_engine(cmdline: str) -> bool:
    return any(marker in cmdline for marker in ENGINE_PROCESS_MARKERS)


def _processes() -> dict[int, str]:
    processes = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                raw = (entry / "cmdline").read_bytes()
                processes[int(entry.name)] = raw.replace(b"\0", b" ").decode(errors="replace")
    return processes


def _parents() -> dict[int, int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


@contextlib.contextmanager
def serve_run(
    name_or_path: str,
    *,
    ray_address: str | None = None,
    port: int = 8000,
    ready_timeout_s: float = 420.0,
    stop_timeout_s: float = 90.0,
    log_dir: Path | None = None,
) -> Iterator[RunningApp]:
    """Run ``serve run`` for a config until the block ends; wait for every engine to be ready."""
    path = config_path(name_or_path)
    if not path.exists():
        raise LaunchError(f"no such config: {path}")
    if _port_in_use(port):
        # Serve binds with SO_REUSEPORT: a second app would silently share the traffic.
        raise LaunchError(f"port {port} is already serving; stop that server first")
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="splitserve-"))
    log_path = log_dir / f"serve-{path.stem}.log"
    env = CLUSTER_ENV | dict(os.environ)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [_serve_cli(), "run", str(path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=default_sigint,
        )
    base_url = f"http://127.0.0.1:{port}"
    engines: set[int] = set()
    try:
        _wait_ready(process, base_url, log_path, ready_timeout_s)
        engines = app_engine_pids()
        yield RunningApp(base_url=base_url, config_path=path, log_path=log_path)
    finally:
        # Restarted replicas may have started new engines since the app came up.
        engines |= app_engine_pids()
        _stop(process, stop_timeout_s)
        leftovers = _wait_engines_gone(engines, stop_timeout_s)
        if leftovers:
            _kill(leftovers)
            raise LaunchError(
                f"engine processes {sorted(leftovers)} outlived {path.name}; killed them"
            )


RAY_WORKER_NICENESS = 15  # Ray's default worker_niceness: proxy, router, engines


@contextlib.contextmanager
def niced_like_ray_workers() -> Iterator[None]:
    """Run this process (and what it starts) at the niceness of Ray's workers.

    A client at niceness 0 on the cluster's own cores takes them from the serving
    processes it measures; a client on another machine would not.
    """
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, max(before, RAY_WORKER_NICENESS))
    try:
        yield
    finally:
        with contextlib.suppress(PermissionError):  # only root may lower it again
            os.setpriority(os.PRIO_PROCESS, 0, before)


def default_sigint() -> None:
    """In a child before exec: SIGINT stops it, as `_stop` expects.

    A process started in the background by a shell without job control (`nohup x &`,
    CI runners) inherits SIGINT ignored, and so would `serve run`: it then ignored
    `_stop`'s SIGINT, was killed after the timeout without deleting the application,
    and its replicas and engines stayed in the cluster.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _serve_cli() -> str:
    beside_python = Path(sys.executable).with_name("serve")
    return str(beside_python) if beside_python.exists() else (shutil.which("serve") or "serve")


def _wait_ready(
    process: subprocess.Popen[bytes], base_url: str, log_path: Path, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"serve run exited with {process.returncode}:\n{_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{base_url}/health", timeout=10)
            if response.status_code == 200:
                return
        time.sleep(2)
    raise LaunchError(f"not ready after {timeout_s:.0f}s:\n{_tail(log_path)}")


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_engines_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = alive & engine_pids()
    return alive


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
