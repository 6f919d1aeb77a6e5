"""A pool that follows a ramp: from one engine to four as closed-loop clients double,
and back to one when they stop, one engine at a time and with no request failed
(issue 26's autoscaling target; ``SloPolicy`` in engines/pool_scaling.py).

Synthetic engines serve two requests at a time at 10 ms a token, so a queue, and a
first token later than the SLO, comes from a handful of clients and no model. The
``ramp`` model of the model-free served tests' shared application
(tests/support/shared_apps.py: ``SCALED_TO_FOUR``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.scaled_pools import complete, members
from tests.support.shared_apps import RAMP_ENGINES, synthetic_models
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

RAMP_MODEL = synthetic_models(Path())["ramp"]
MAX_ENGINES = RAMP_ENGINES
TOKENS = 50  # half a second on an engine slot
# Closed-loop clients, doubled every RAMP_STEP_S: two fit one engine's two slots, and
# sixteen queue long enough on three engines (six slots) to ask for the fourth.
RAMP = (2, 4, 8, 16)
RAMP_STEP_S = 10.0
# Load kept on the full pool, so that every engine has served before it stops.
AT_PEAK_S = 3.0
SCALE_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def ramp_pool(model_free_app: RunningApp) -> RunningApp:
    return model_free_app


class ClosedLoop:
    """Clients that each send the next request when the last is answered."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.answers: list[httpx.Response] = []

    def grow_to(self, clients: int) -> None:
        while len(self._threads) < clients:
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _client(self) -> None:
        while not self._stop.is_set():
            self.answers.append(complete(self._url, TOKENS, RAMP_MODEL.name))


def test_the_pool_follows_a_ramp_to_four_engines_and_back_to_one(
    ramp_pool: RunningApp,
) -> None:
    url = ramp_pool.base_url
    sizes = [len(members(url, RAMP_MODEL.name))]
    assert sizes == [1]
    load = ClosedLoop(url)
    try:
        for clients in RAMP:
            load.grow_to(clients)
            step_ends = time.monotonic() + RAMP_STEP_S
            while time.monotonic() < step_ends and sizes[-1] < MAX_ENGINES:
                time.sleep(0.5)
                sizes.append(len(members(url, RAMP_MODEL.name)))
        eventually(lambda: len(members(url, RAMP_MODEL.name)) == MAX_ENGINES, SCALE_TIMEOUT_S)
        time.sleep(AT_PEAK_S)
    finally:
        load.stop()
    eventually(lambda: len(members(url, RAMP_MODEL.name)) == 1, SCALE_TIMEOUT_S)

    assert sizes == sorted(sizes), f"the pool shrank while the load grew: {sizes}"
    assert {answer.status_code for answer in load.answers} == {200}
    assert {answer.json()["usage"]["completion_tokens"] for answer in load.answers} == {TOKENS}
    served_by = {answer.headers["x-splitserve-replica"] for answer in load.answers}
    assert len(served_by) >= MAX_ENGINES, f"every engine the pool grew takes requests: {served_by}"
