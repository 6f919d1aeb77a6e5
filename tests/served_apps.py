"""One started application at a time for the whole session, kept while tests ask for the
same YAML.

Starting an application (Serve, the router, its vLLM engines) takes one to three minutes
on this box: most of what the serving tests cost. Modules that serve the same YAML share
one start, and ``conftest.py`` runs them next to each other. An application is handed
out again only while every router answers ``/health``; one a test left broken is
replaced. Stopping is checked as ``serve_run`` checks it (no engine outlives the
application), and the log written while it stopped must show no replica restarted or
failed because of the stop.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from deployments.launcher import RunningApp, config_path, serve_run
from splitserve.processes import http_ok

# Lines Serve or our engine client log when stopping broke something: a replica that
# died was started again, or work was submitted to an executor already shut down.
STOP_FAILURES = ("starting a new one", "cannot schedule new futures after shutdown")


class ServedApps:
    def __init__(self, ray_address: str, log_dir: Path) -> None:
        self._ray_address = ray_address
        self._log_dir = log_dir
        self._app: RunningApp | None = None
        self._stack: ExitStack | None = None

    def get(self, name_or_path: str, *, fresh: bool = False) -> RunningApp:
        """The application for a YAML under deployments/ (by name) or anywhere (by path),
        started unless the running one is it and serves; ``fresh``: started anew."""
        path = config_path(name_or_path).resolve()
        app = self._app
        if not fresh and app is not None and app.config_path.resolve() == path and _serves(app):
            return app
        self.close()
        stack = ExitStack()
        self._app = stack.enter_context(
            serve_run(str(path), ray_address=self._ray_address, log_dir=self._log_dir)
        )
        self._stack = stack
        return self._app

    def close(self) -> None:
        """Stop the running application, if any (its port is free afterwards)."""
        app, stack = self._app, self._stack
        if app is None or stack is None:
            return
        self._app = self._stack = None
        offset = app.log_path.stat().st_size if app.log_path.exists() else 0
        stack.close()
        with app.log_path.open(errors="replace") as log:
            log.seek(offset)
            stopping = log.read()
        broken = [line for line in stopping.splitlines() if any(f in line for f in STOP_FAILURES)]
        assert not broken, f"{app.config_path.name} broke while stopping: {broken[:3]}"


def _serves(app: RunningApp) -> bool:
    return all(http_ok(f"{url}/health") for url in app.router_urls)
