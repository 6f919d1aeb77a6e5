"""Start and stop a splitserve application exactly as a user does: ``serve run FILE.yaml``
with the cluster settings of ``python -m deployments.serve`` (Serve's direct ingress).

Used by the demo, the tests and the benchmarks, so they all exercise the real entry
point. Stopping is graceful first (SIGINT makes ``serve run`` shut the application
down, which shuts every engine down) and then checked: no vLLM engine process that
the application started may outlive it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from deployments.config import refuse_engine_overrides
from engines.settings import ENGINE_NAME_ENV
from splitserve.processes import (
    RAY_WORKER_NICENESS,
    SERVE_DEPLOY_FAILED,
    LaunchError,
    command_lines,
    descendants,
    http_ok,
    pids_with_env_entry,
    start_process,
    stop_process,
    wait_until_ready,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEPLOYMENTS_DIR = REPO_ROOT / "deployments"
ENGINE_PROCESS_MARKERS = ("VLLM::", "EngineCore")
APP_NAME = "splitserve"  # the application name in every YAML under deployments/
DEFAULT_PORT = 8000
ROUTER_DEPLOYMENT = "Router"


def router_replicas(path: Path) -> int:
    """How many router replicas a Serve YAML asks for (``deployments: [{name: Router,
    num_replicas: N}]``); each one serves a port of its own under direct ingress."""
    document = yaml.safe_load(path.read_text()) or {}
    for application in document.get("applications") or []:
        for deployment in application.get("deployments") or []:
            if deployment.get("name") == ROUTER_DEPLOYMENT:
                return int(deployment.get("num_replicas", 1))
    return 1


def proxy_port(port: int, ingress_replicas: int = 1) -> int:
    """Where Serve's proxy listens: just above the routers' ports (see cluster_env)."""
    return port + ingress_replicas


def cluster_env(port: int = DEFAULT_PORT, ingress_replicas: int = 1) -> dict[str, str]:
    """Environment for a Ray cluster that serves us, read only where the cluster starts.

    Serve's direct ingress: the router replica serves HTTP on ``port`` itself, so a
    token crosses no Serve proxy (bench/overhead.py, docs/DECISIONS.md). Replica ports
    come from a range; a range of one makes it ``port`` (``ingress_replicas`` routers
    take ``port`` onwards, one port each, for a load balancer in front). Serve holds a
    released port back and drains an ingress replica for the load balancers in front of a cluster;
    with none here, both are short, so a restarted application gets its port at once.
    Serve's proxy still starts on the head node and must leave ``port`` (see
    ``direct_ingress_config``).
    """
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + ingress_replicas),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def direct_ingress_config(
    path: Path, port: int = DEFAULT_PORT, ingress_ports: int | None = None
) -> Path:
    """A copy of a Serve YAML whose proxy listens beside ``port``, which the router takes.
    ``ingress_ports``: how many ports from ``port`` the cluster gives routers (its
    ``cluster_env``); the proxy listens past them (by default past this YAML's routers).

    The YAMLs keep ``port`` for Serve's proxy, so that a plain ``serve run FILE`` on a
    cluster without ``cluster_env`` serves there too, through the proxy.
    """
    config = yaml.safe_load(path.read_text())
    http_options = config.setdefault("http_options", {})
    http_options["port"] = proxy_port(port, _ports_taken(path, ingress_ports))
    folder = Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    copy = folder / f"{path.stem}.direct-ingress-{port}.yaml"
    copy.write_text(f"# Written from {path} by deployments.launcher.\n" + yaml.safe_dump(config))
    return copy


# Linux holds a closed connection's address for 60 s (TIME_WAIT), a little margin on top.
TIME_WAIT_S = 65.0


def wait_until_bindable(port: int, timeout_s: float = TIME_WAIT_S) -> None:
    """Wait until a new server could bind ``port`` the way Serve's direct ingress does.

    That bind sets no SO_REUSEADDR, so the connections a stopped router closed itself
    keep the port for a minute; a replica that cannot bind has Serve block the port for
    good (ray/serve/_private/replica.py, Ray 2.60) and the application never comes up.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
                return
            except OSError as error:
                if time.monotonic() > deadline:
                    message = f"port {port} stayed taken for {timeout_s:.0f}s: {error}"
                    raise LaunchError(message) from error
        time.sleep(1.0)


def simulated_config(
    path: Path, profile: str, time_scale: float = 1.0, spend: str = "wall"
) -> Path:
    """A copy of a Serve YAML whose engines are simulated (engine.backend: simulated) on
    ``profile``'s time, each model's pools and policies as they are: the same shape on a
    GPU fleet's time, on this machine (``spend``: engine.spend, wall or cpu)."""
    config = yaml.safe_load(path.read_text())
    if Path(profile).exists():
        profile = str(Path(profile).resolve())  # replicas do not start in this folder
    engine = {"backend": "simulated", "profile": profile, "time_scale": time_scale}
    if spend != "wall":
        engine["spend"] = spend
    for application in config.get("applications", []):
        args = application.setdefault("args", {})
        # A simulated engine holds no device: a GPU YAML (one the advisor wrote, say)
        # must start where there is none, its engines asking Ray for CPUs only.
        args["accelerator"] = "cpu"
        models = args.get("models")
        for model_args in models if isinstance(models, list) else [args]:
            model_args["engine"] = engine
            # Simulated engines hand over simulated KV; the YAML's backend is for vLLM.
            model_args.pop("kv_transfer", None)
    folder = Path(tempfile.gettempdir()) / f"splitserve-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    copy = folder / f"{path.stem}.simulated.yaml"
    copy.write_text(f"# Written from {path} by deployments.launcher.\n" + yaml.safe_dump(config))
    return copy


def serve_command(
    path: Path, port: int = DEFAULT_PORT, ingress_ports: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """``serve run`` of a config with direct ingress on ``port``: argv and environment."""
    refuse_engine_overrides(path)
    argv = [_serve_cli(), "run", str(direct_ingress_config(path, port, ingress_ports))]
    return argv, cluster_env(port, _ports_taken(path, ingress_ports)) | dict(os.environ)


def _ports_taken(path: Path, ingress_ports: int | None) -> int:
    """The direct-ingress ports from the base port: the cluster's range where known, and
    at least this YAML's routers."""
    return max(ingress_ports or 1, router_replicas(path))


@dataclass(frozen=True)
class RunningApp:
    base_url: str
    config_path: Path
    log_path: Path
    # One per router replica (direct ingress); base_url is the first.
    router_urls: tuple[str, ...] = ()
    proxy_url: str | None = None


def config_path(name_or_path: str) -> Path:
    """``dp`` names ``deployments/dp.yaml``; anything with a slash or suffix is a path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) > 1:
        return candidate.resolve()
    return DEPLOYMENTS_DIR / f"{name_or_path}.yaml"


def engine_pids() -> set[int]:
    """PIDs of vLLM engine-core and worker processes on this machine."""
    return {pid for pid, cmdline in command_lines().items() if _is_engine(cmdline)}


def app_engine_pids(app_name: str = APP_NAME) -> set[int]:
    """Engine processes started by the Serve replicas of one application."""
    replica_prefix = f"ray::ServeReplica:{app_name}:"
    lines = command_lines()
    replicas = [pid for pid, cmdline in lines.items() if cmdline.startswith(replica_prefix)]
    return set().union(*(descendant_engine_pids(pid) for pid in replicas))


def app_replica_pids(app_name: str = APP_NAME) -> set[int]:
    """The Serve replica processes of one application on this machine."""
    prefix = f"ray::ServeReplica:{app_name}:"
    return {pid for pid, cmdline in command_lines().items() if cmdline.startswith(prefix)}


def wait_replicas_gone(app_name: str = APP_NAME, timeout_s: float = 90.0) -> set[int]:
    """Wait until the application's replicas on this machine have exited, as they do a
    moment after ``serve run`` stops on a cluster it did not start; the ones left."""
    deadline = time.monotonic() + timeout_s
    while (left := app_replica_pids(app_name)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def replica_engine_pids(replica: str) -> set[int]:
    """The processes of one engine replica (``prefill-0``), wherever it is hosted: each
    carries its replica's name in its environment (ENGINE_NAME_ENV)."""
    marker = f"{ENGINE_NAME_ENV}={replica}".encode()
    engines = {pid for pid, cmdline in command_lines().items() if _is_engine(cmdline)}
    return engines & pids_with_env_entry(lambda entry: entry == marker)


def descendant_engine_pids(root: int) -> set[int]:
    """Engine processes below one process (a server we started), however deep."""
    below = {pid for pid, _ in descendants(root)}
    return {pid for pid, cmdline in command_lines().items() if pid in below and _is_engine(cmdline)}


def _is_engine(cmdline: str) -> bool:
    return any(marker in cmdline for marker in ENGINE_PROCESS_MARKERS)


# How long serve_run waits for every router to answer before it stops the start.
READY_TIMEOUT_S = 420.0


@contextlib.contextmanager
def serve_run(
    name_or_path: str,
    *,
    ray_address: str | None = None,
    port: int = DEFAULT_PORT,
    direct_ingress: bool = True,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_timeout_s: float = 90.0,
    log_dir: Path | None = None,
    ingress_ports: int | None = None,
) -> Iterator[RunningApp]:
    """Run ``serve run`` for a config until the block ends; wait for every engine to be ready.

    The router serves ``port`` through Serve's direct ingress (``cluster_env``): a
    cluster this starts gets that environment; one at ``ray_address`` must have it.
    ``ingress_ports``: the width of that cluster's port range (``cluster_env``'s
    ``ingress_replicas``), where it is wider than this YAML's routers: applications of
    one router and of several then share one cluster, and Serve's proxy listens past
    the range. ``direct_ingress=False`` runs the YAML as it is, through Serve's proxy.
    """
    path = config_path(name_or_path)
    if not path.exists():
        raise LaunchError(f"no such config: {path}")
    if _port_in_use(port):
        # Serve binds with SO_REUSEPORT: a second app would silently share the traffic.
        raise LaunchError(f"port {port} is already serving; stop that server first")
    if direct_ingress:
        wait_until_bindable(port)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="splitserve-"))
    log_path = log_dir / f"serve-{path.stem}.log"
    if direct_ingress:
        argv, env = serve_command(path, port, ingress_ports)
    else:
        refuse_engine_overrides(path)
        argv, env = [_serve_cli(), "run", str(path)], dict(os.environ)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    with sigterm_unwinds():
        yield from _serve_until_done(
            path,
            argv,
            env,
            log_path,
            (port, _ports_taken(path, ingress_ports)),
            direct_ingress,
            ready_timeout_s,
            stop_timeout_s,
        )


def _serve_until_done(
    path: Path,
    argv: list[str],
    env: dict[str, str],
    log_path: Path,
    ports: tuple[int, int],
    direct_ingress: bool,
    ready_timeout_s: float,
    stop_timeout_s: float,
) -> Iterator[RunningApp]:
    """``ports``: the routers' first port, and how many the cluster gives routers."""
    process = start_process(argv, log_path, cwd=REPO_ROOT, env=env)
    port, ingress_ports = ports
    replicas = router_replicas(path) if direct_ingress else 1
    router_urls = tuple(f"http://127.0.0.1:{port + index}" for index in range(replicas))
    proxy = proxy_port(port, ingress_ports)
    proxy_url = f"http://127.0.0.1:{proxy}" if direct_ingress else None
    engines: set[int] = set()
    try:
        ready = functools.partial(_routers_ready, router_urls, proxy_url)
        wait_until_ready(
            process, ready, log_path, ready_timeout_s, "serve run", SERVE_DEPLOY_FAILED
        )
        engines = app_engine_pids()
        yield RunningApp(router_urls[0], path, log_path, router_urls, proxy_url)
    finally:
        # Restarted replicas may have started new engines since the app came up.
        engines |= app_engine_pids()
        stop_process(process, stop_timeout_s)
        leftovers = _wait_engines_gone(engines, stop_timeout_s)
        if leftovers:
            _kill(leftovers)
            raise LaunchError(
                f"engine processes {sorted(leftovers)} outlived {path.name}; killed them"
            )
        # On a cluster `serve run` did not start, its stop returns while the replicas
        # still exit; the next application must not find them on its port.
        if replicas_left := wait_replicas_gone(timeout_s=stop_timeout_s):
            raise LaunchError(f"replicas {sorted(replicas_left)} outlived {path.name}")


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within the block, SIGTERM (kill, a service manager, CI's timeout) unwinds the
    main thread as Ctrl-C does, so an application started in it stops with the process
    rather than outliving it, serving. Elsewhere than the main thread, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the stop short
    raise SystemExit(128 + signum)


def _routers_ready(router_urls: tuple[str, ...], proxy_url: str | None) -> bool:
    if all(http_ok(f"{url}/health") for url in router_urls):
        return True
    # Asked again after the proxy: the router may have come up between the two.
    base_url = router_urls[0]
    if proxy_url and http_ok(f"{proxy_url}/health") and not http_ok(f"{base_url}/health"):
        raise LaunchError(
            f"the application answers on Serve's proxy at {proxy_url}, not {base_url}: the"
            " cluster was started without deployments.launcher.cluster_env()"
        )
    return False


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


def _port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _serve_cli() -> str:
    beside_python = Path(sys.executable).with_name("serve")
    return str(beside_python) if beside_python.exists() else (shutil.which("serve") or "serve")


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
