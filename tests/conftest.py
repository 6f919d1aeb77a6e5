"""Shared fixtures: one real Ray cluster for the session, applications started with ``serve run``.

The session ends by stopping Ray and checking that no Ray or vLLM process it started
is left; leftovers are killed and reported as an error, also when tests failed. The
KV-event folders of engine hosts that tests killed are removed, as a new relay would.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import pytest

# The session's cluster uses token authentication, with a token of its own: a fresh
# machine has no ~/.ray/auth_token, and `ray start` in token mode refuses to start
# without one. Ray reads these variables once, when this process first imports it, so
# they are set before anything imports Ray (deployments.launcher does, through
# deployments.config); every client of the session (`serve run`, the state API)
# inherits them.
assert "ray" not in sys.modules, "Ray was imported before the tests chose its auth mode"
os.environ.setdefault("RAY_AUTH_MODE", "token")
if not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & os.environ.keys():
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)

from deployments.launcher import (  # noqa: E402
    DEFAULT_PORT,
    RunningApp,
    cluster_env,
    niced_like_ray_workers,
)
from engines.socket_folders import remove_orphaned_folders  # noqa: E402
from splitserve.processes import pids_with_env_entry  # noqa: E402
from tests.support import api_corpus  # noqa: E402
from tests.support.bare_vllm import bare_vllm  # noqa: E402
from tests.support.local_ports import (  # noqa: E402
    SESSION_INGRESS_PORTS,
    forget_cluster,
    free_port,
)
from tests.support.served_apps import ServedApps  # noqa: E402
from tests.support.shared_apps import SHAPES, shared_app, synthetic_app  # noqa: E402

# Every process this session starts (Ray's daemons and workers, vLLM engines) inherits
# this variable, so the final check finds exactly ours, orphans included.
SESSION_MARKER = "SPLITSERVE_TEST_SESSION"
# How often every process of the session's cluster exports its metrics to Ray's agent
# (Ray's default is 10 s): the dashboard tests wait for a number of exports, and at
# 10 s each those waits were a minute of the suite.
RAY_METRICS_EXPORT_MS = 2000
# vLLM names its IPC sockets by a UUID (vllm.utils.network_utils.get_open_zmq_ipc_path).
_UUID_NAME = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _session_pids(token: str) -> set[int]:
    """Processes that carry the marker, and their descendants: a process that sets its
    title (Ray's agents, vLLM's engines) may write it over its environment, marker
    included, and a full run once left Ray's dashboard agent unfound that way."""
    needle = f"{SESSION_MARKER}={token}".encode()
    pids = pids_with_env_entry(lambda entry: needle in entry) - {os.getpid()}
    return pids | {child for pid in pids for child in _descendants(pid)}


def _running(pid: int) -> bool:
    """Alive and not a zombie (nothing may reap an orphan in a container)."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def _descendants(pid: int) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    return set()


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head for the whole session, small and quiet: the engines get the cores."""
    token = uuid.uuid4().hex
    os.environ[SESSION_MARKER] = token
    loose_before = _loose_ipc_sockets()
    port = free_port()
    env = cluster_env(DEFAULT_PORT, SESSION_INGRESS_PORTS) | dict(
        os.environ,
        RAY_USAGE_STATS_ENABLED="0",
        RAY_metrics_report_interval_ms=str(RAY_METRICS_EXPORT_MS),
    )
    started = subprocess.run(
        [
            _ray_cli(),
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=4",
            # The dashboard serves Ray's state API, which the PD tests ask for objects.
            "--include-dashboard=true",
            f"--dashboard-port={free_port()}",
            "--disable-usage-stats",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        pytest.fail(f"`ray start` failed ({started.returncode}):\n{started.stderr[-3000:]}")
    address = f"127.0.0.1:{port}"
    try:
        yield address
    finally:
        # Every serve app has been stopped by now: an engine still alive has leaked.
        session = _session_pids(token)
        leaked_engines = {pid for pid in session if _is_engine(pid)}
        # Like `ray stop` (which would stop every Ray on the machine, not only ours):
        # SIGTERM, then SIGKILL for daemons that ignore it (gcs_server, raylet do).
        _signal_all(session, signal.SIGTERM)

        # The daemons' children are orphans once the daemons are gone: keep their PIDs.
        def alive() -> set[int]:
            return {pid for pid in session | _session_pids(token) if _running(pid)}

        _signal_all(_wait_gone(alive, timeout_s=10), signal.SIGKILL)
        leftovers = _wait_gone(alive, timeout_s=10)
        forget_cluster(port)
        # An engine host that a test killed could not remove its socket folders; the next
        # host on the node would (engines/socket_folders.py), but none starts after this.
        remove_orphaned_folders(Path(tempfile.gettempdir()))
        loose = sorted(_loose_ipc_sockets() - loose_before)
        assert not loose, f"vLLM IPC sockets left in the temporary directory: {loose[:5]}"
        assert not leaked_engines, f"vLLM engines outlived their apps: {sorted(leaked_engines)}"
        assert not leftovers, f"processes survived SIGKILL: {sorted(leftovers)}"


def _loose_ipc_sockets() -> set[str]:
    """Sockets named as vLLM names its IPC sockets, loose in the temporary directory
    rather than in a folder that goes with their engine (engines/socket_folders.py)."""
    found = set()
    for entry in os.scandir(tempfile.gettempdir()):
        if _UUID_NAME.fullmatch(entry.name) and stat.S_ISSOCK(
            entry.stat(follow_symlinks=False).st_mode
        ):
            found.add(entry.name)
    return found


def _is_engine(pid: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return "VLLM::" in " ".join(psutil.Process(pid).cmdline())
    return False


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _wait_gone(alive: Callable[[], set[int]], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    pids = alive()
    while pids and time.monotonic() < deadline:
        time.sleep(0.5)
        pids = alive()
    return pids


@pytest.fixture
def cluster_pids(ray_address: str) -> Callable[[], set[int]]:
    """The session cluster's processes at the time of the call: Ray's daemons and
    workers, `serve run`, vLLM engines; not this test process."""
    token = os.environ[SESSION_MARKER]
    return lambda: _session_pids(token)


@pytest.fixture(scope="session")
def serve_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(name="niced_like_ray_workers")
def niced_like_ray_workers_fixture() -> Iterator[None]:
    """This test's clients run at the cluster's niceness (the overload test must not take
    the two cores from the cluster it overloads)."""
    with niced_like_ray_workers():
        yield


_STARTED_APPS: list[ServedApps] = []  # the session's ServedApps, once a test asked for it


@pytest.fixture(scope="session")
def served_apps(ray_address: str, serve_logs: Path) -> Iterator[ServedApps]:
    """The session's one running application, shared by modules that serve the same YAML."""
    apps = ServedApps(ray_address, serve_logs)
    _STARTED_APPS.append(apps)
    try:
        yield apps
    finally:
        apps.close()


@pytest.fixture(scope="session")
def bare_vllm_answers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Bare `vllm serve`'s answers to what each collected module asks of it, by module.

    A module that holds the router to bare vLLM defines ``bare_vllm_reference(base_url)``
    (tests/support/api_corpus.py too, for every shape's modules). All of them are asked
    of one bare server, started once for the session's first that needs it (or early,
    beside the tests that need no cluster), and stopped again at once: it would hold a
    core's worth of memory and a port for nothing."""
    return _bare_vllm_answers(request.session, tmp_path_factory).result()


_BARE_ANSWERS: list[Future[dict[str, Any]]] = []  # the session's one asking of bare vLLM


def _bare_vllm_answers(
    session: pytest.Session, tmp_path_factory: pytest.TempPathFactory
) -> Future[dict[str, Any]]:
    """The session's bare vLLM answers, asked in a thread of their own on the first call."""
    if not _BARE_ANSWERS:
        modules = {item.module for item in session.items if isinstance(item, pytest.Function)}
        askers = [m for m in modules if hasattr(m, "bare_vllm_reference")]
        askers.append(api_corpus)
        folder = tmp_path_factory.mktemp("bare-vllm")

        def ask() -> dict[str, Any]:
            with bare_vllm(folder) as url:
                return {module.__name__: module.bare_vllm_reference(url) for module in askers}

        asker = ThreadPoolExecutor(1, thread_name_prefix="bare-vllm")
        _BARE_ANSWERS.append(asker.submit(ask))
        asker.shutdown(wait=False)  # the thread ends with the asking
    return _BARE_ANSWERS[0]


@pytest.fixture(scope="session", autouse=True)
def _first_application_started_early(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """What the first serving test needs, bare vLLM's answers and the shapes' shared
    application, starts in threads while the tests that need no cluster run before it:
    that start took 264 s of both cores, those tests 245 s of one. The engines run at
    Ray's niceness (bare vLLM at the same), so the tests that run meanwhile keep their
    core (except for processes in a session of their own: ``early_starts_done``)."""
    items = request.session.items
    serving = [item for item in items if item.get_closest_marker("serving") is not None]
    if not serving or serving[0] is items[0]:
        return
    needs = set(getattr(serving[0], "fixturenames", ()))
    if "bare_vllm_answers" in needs:
        _bare_vllm_answers(request.session, tmp_path_factory)
    if "shapes_app" in needs:
        apps: ServedApps = request.getfixturevalue("served_apps")
        logs: Path = request.getfixturevalue("serve_logs")
        apps.start_early(_shapes_app_path(logs))


@pytest.fixture
def early_starts_done() -> None:
    """Waits until the early starts (``_first_application_started_early``) have ended.
    For a test whose processes run in a niced session of their own (the load
    generator's launched servers): the kernel's autogroup shares the CPU between
    sessions first, and the starting engines, children of this session's Ray cluster,
    count as this session's, so such a process got no CPU for a minute (the sweep's
    first server came up 68 s late, under its 120 s ready timeout)."""
    wait(_BARE_ANSWERS)
    for apps in _STARTED_APPS:
        apps.wait_early()


def _shapes_app_path(serve_logs: Path) -> str:
    """The shapes' shared application's YAML: the same path for the early start and for
    ``shapes_app``, which takes that start over only for the same path."""
    return str(shared_app(serve_logs, "shapes", SHAPES))


@pytest.fixture(scope="module")
def shapes_app(served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    """The shipped shapes as the models of one application (tests/support/shared_apps.py):
    single.yaml's model first, answering under its own name and for bodies that name none.
    Started once for every module that asks for it (conftest.SERVING_ORDER keeps them
    together); a test that kills engines asks ``served_apps.get`` itself."""
    return served_apps.get(_shapes_app_path(serve_logs))


@pytest.fixture(scope="module")
def model_free_app(served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    """dp.yaml's router on synthetic engines, as each model-free served test needs it, as
    the models of one application behind two routers (tests/support/shared_apps.py)."""
    return served_apps.get(str(synthetic_app(serve_logs)))


@pytest.fixture(scope="module", autouse=True)
def _no_idle_app_beside_other_serving_tests(request: pytest.FixtureRequest) -> None:
    """A serving module that does not use the shared application runs without it: an idle
    one would hold port 8000 and take memory and CPU from the module's own cluster."""
    module_items = [i for i in request.session.items if _module_of(i) is request.module]
    uses_apps = any("served_apps" in getattr(i, "fixturenames", ()) for i in module_items)
    serving = any(i.get_closest_marker("serving") for i in module_items)
    if serving and not uses_apps:
        for apps in _STARTED_APPS:
            apps.close()


# Serving modules in the order that lets consecutive ones share a started application
# (served_apps.py, tests/support/shared_apps.py): the shapes' shared application (its
# single.yaml model is every other shape's reference), the modules that kill its engines
# last; pd.yaml, started cold and then used warm; the model-free shared application.
# Modules not named here keep pytest's order after them; modules that need no cluster
# run first, the tests among them that wait for the early starts last.
SERVING_ORDER = (
    # The shapes' shared application.
    "tests.router.http.test_hostile_served",
    "tests.loadgen.test_agreement_served",
    "tests.deployments.test_shapes_served",
    "tests.deployments.test_auto_served",
    "tests.deployments.test_models_served",
    "tests.deployments.test_pd_served",  # kills an engine
    "tests.router.pool.test_engine_in_router_served",  # kills an engine
    # Applications of their own.
    "tests.deployments.test_auto_scaled_served",
    "tests.deployments.test_cold_start_served",  # pd.yaml, cold ...
    "tests.router.policies.test_policies_served",  # ... then warm
    "tests.dashboards.test_prometheus_served",
    # The model-free served tests' shared application.
    "tests.router.pool.test_replicas_served",
    "tests.engines.test_engine_groups_served",
    "tests.router.observation.test_traffic_served",
    "tests.engines.test_scaled_pool_served",
    "tests.engines.test_pool_ramp_served",
    "tests.engines.simulated.test_simulated_served",
    "tests.engines.test_replicas_served",  # kills engines and a router
)


@pytest.hookimpl(trylast=True)  # after pytest groups items by their module-scoped params
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker("serving") is None:
            # Those that wait for the early starts last, when there is least left to wait.
            return 0, int("early_starts_done" in getattr(item, "fixturenames", ()))
        found = _module_of(item)
        module = found.__name__ if found is not None else ""
        in_order = module in SERVING_ORDER
        return 1 + (SERVING_ORDER.index(module) if in_order else len(SERVING_ORDER)), 0

    items.sort(key=rank)  # stable: each module's own order is kept


def _module_of(item: pytest.Item) -> ModuleType | None:
    """The test module an item was collected from (a Function's ``module``)."""
    return item.module if isinstance(item, pytest.Function) else None


def _check_serving_order_names_modules() -> None:
    """A module renamed but not here would lose its place silently, and its app with it."""
    root = Path(__file__).resolve().parent.parent
    missing = [m for m in SERVING_ORDER if not (root / f"{m.replace('.', '/')}.py").exists()]
    if missing:
        raise pytest.UsageError(
            f"conftest.SERVING_ORDER names modules that do not exist: {missing}"
        )


_check_serving_order_names_modules()
