"""One started application at a time for the whole session, kept while tests ask for the
same YAML.

Starting an application (Serve, the router, its vLLM engines) takes one to three minutes
on this box: most of what the serving tests cost. Modules that serve the same YAML share
one start, and ``conftest.py`` runs them next to each other. An application is handed
out again only while every router answers ``/health``; one a test left broken is
replaced. Stopping is checked as ``serve_run`` checks it (no engine outlives the
application), and its log must show no replica restarted or failed, neither while it
stopped nor while tests used it, except for tests that kill engines and say so
(``restarts_expected``).

The session's first application may start early (``start_early``), in a thread, while
the tests that need no cluster run: its engines run at Ray's niceness, so those tests
keep their core, and the start takes the other.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from deployments.launcher import READY_TIMEOUT_S, RunningApp, config_path, serve_run
from splitserve.processes import http_ok
from tests.support.local_ports import SESSION_INGRESS_PORTS

# Lines Serve or our engine client log when something broke: a replica that died was
# started again, or work was submitted to an executor already shut down.
REPLICA_FAILURES = ("starting a new one", "cannot schedule new futures after shutdown")
# The early start shares the box with the tests that need no cluster, by design: it
# took 330-400 s of serve run's READY_TIMEOUT_S (420 s) on this box (docs/DECISIONS.md,
# issue 55), so a slower machine would fail it for being slow, not broken. Later starts
# keep the default.
EARLY_READY_TIMEOUT_S = 900.0


class ServedApps:
    def __init__(self, ray_address: str, log_dir: Path) -> None:
        self._ray_address = ray_address
        self._log_dir = log_dir
        self._app: RunningApp | None = None
        self._stack: ExitStack | None = None
        # Where the running application's log must show no restart or failure from.
        self._checked_from: int | None = None
        self._early: Future[tuple[RunningApp, ExitStack]] | None = None

    def start_early(self, name_or_path: str) -> None:
        """Start the application for a YAML in a thread; the next ``get`` or ``close``
        takes it over (and raises what its start raised)."""
        path = config_path(name_or_path).resolve()
        starter = ThreadPoolExecutor(1, thread_name_prefix="early-app")
        self._early = starter.submit(self._started, path, EARLY_READY_TIMEOUT_S)
        starter.shutdown(wait=False)  # the thread ends with the start

    def wait_early(self) -> None:
        """Until the early start, if one runs, has ended (without taking it over)."""
        if self._early is not None:
            wait([self._early])

    def _started(
        self, path: Path, ready_timeout_s: float = READY_TIMEOUT_S
    ) -> tuple[RunningApp, ExitStack]:
        stack = ExitStack()
        app = stack.enter_context(
            serve_run(
                str(path),
                ray_address=self._ray_address,
                log_dir=self._log_dir,
                ingress_ports=SESSION_INGRESS_PORTS,
                ready_timeout_s=ready_timeout_s,
            )
        )
        return app, stack

    def _take_over_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            self._app, self._stack = early.result()
            self._checked_from = 0

    def get(
        self, name_or_path: str, *, fresh: bool = False, restarts_expected: bool = False
    ) -> RunningApp:
        """The application for a YAML under deployments/ (by name) or anywhere (by path),
        started unless the running one is it and serves; ``fresh``: started anew.
        ``restarts_expected``: the caller kills engines, so its replicas restart."""
        path = config_path(name_or_path).resolve()
        self._take_over_early()
        app = self._app
        reused = not fresh and app is not None and app.config_path.resolve() == path
        if not (reused and app is not None and _serves(app)):
            self.close()
            app, self._stack = self._started(path)
            self._app, self._checked_from = app, 0
        if restarts_expected:
            self._check_log(app, "while tests used it")  # what came before this caller
            self._checked_from = None
        elif self._checked_from is None:
            self._checked_from = _log_size(app)
        return app

    def close(self) -> None:
        """Stop the running application, if any (its port is free afterwards)."""
        self._take_over_early()
        app, stack = self._app, self._stack
        if app is None or stack is None:
            return
        self._app = self._stack = None
        if self._checked_from is None:  # the last caller killed engines: the stop alone
            self._checked_from = _log_size(app)
        stack.close()
        self._check_log(app, "while tests used it or while it stopped")
        _check_no_connection_left(app)

    def _check_log(self, app: RunningApp, when: str) -> None:
        if self._checked_from is None or not app.log_path.exists():
            return
        with app.log_path.open(errors="replace") as log:
            log.seek(self._checked_from)
            lines = log.read().splitlines()
        broken = [line for line in lines if any(f in line for f in REPLICA_FAILURES)]
        name = app.config_path.name
        assert not broken, f"{name}: a replica restarted or failed {when}: {broken[:3]}"


def _log_size(app: RunningApp) -> int:
    return app.log_path.stat().st_size if app.log_path.exists() else 0


def _check_no_connection_left(app: RunningApp) -> None:
    """A client of this process that keeps a connection the stopped router closed (one
    not used as a context manager) keeps the router's port in FIN-WAIT-2 for a minute:
    the next application waits that long for it (launcher.wait_until_bindable)."""
    ports = {urlsplit(url).port for url in app.router_urls}
    left = [
        f"{c.laddr.port}->{c.raddr.port} {c.status}"
        for c in psutil.net_connections(kind="tcp")
        if c.pid == os.getpid() and c.raddr and c.raddr.port in ports
    ]
    assert not left, (
        f"{app.config_path.name}: a test left client connections to it open ({left}); close"
        " clients when done with them"
    )


def _serves(app: RunningApp) -> bool:
    return all(http_ok(f"{url}/health") for url in app.router_urls)
