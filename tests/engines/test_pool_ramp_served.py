"""A pool that follows a ramp: from one engine to four as closed-loop clients double,
and back to one when they stop, one engine at a time and with no request failed
(issue 26's autoscaling target; ``SloPolicy`` in engines/pool_scaling.py).

Synthetic engines serve two requests at a time at 10 ms a token, so a queue, and a
first token later than the SLO, comes from a handful of clients and no model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.scaled_pools import complete, members, scaled_synthetic_pool
from tests.support.waiting import eventually

pytestmark = pytest.mark.serving

ENGINE = {"backend": "synthetic", "step_interval_s": 0.01, "max_num_seqs": 2}
MAX_ENGINES = 4
SCALING = {
    "min_replicas": 1,
    "max_replicas": MAX_ENGINES,
    "ttft_slo_s": 1.0,
    "tpot_slo_s": 1.0,
    "upscale_delay_s": 0,
    "downscale_delay_s": 3,
    "window_s": 2,
    "drain_timeout_s": 30,
}
TOKENS = 50  # half a second on an engine slot
# Closed-loop clients, doubled every RAMP_STEP_S: two fit one engine's two slots, and
# sixteen queue long enough on three engines (six slots) to ask for the fourth.
RAMP = (2, 4, 8, 16)
RAMP_STEP_S = 10.0
# Load kept on the full pool, so that every engine has served before it stops.
AT_PEAK_S = 3.0
SCALE_TIMEOUT_S = 150.0


@pytest.fixture(scope="module")
def ramp_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningApp]:
    with scaled_synthetic_pool(tmp_path_factory.mktemp("ramp-pool"), 1, ENGINE, SCALING) as app:
        yield app


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
            self.answers.append(complete(self._url, TOKENS))


def test_the_pool_follows_a_ramp_to_four_engines_and_back_to_one(
    ramp_pool: RunningApp,
) -> None:
    url = ramp_pool.base_url
    sizes = [len(members(url))]
    assert sizes == [1]
    load = ClosedLoop(url)
    try:
        for clients in RAMP:
            load.grow_to(clients)
            step_ends = time.monotonic() + RAMP_STEP_S
            while time.monotonic() < step_ends and sizes[-1] < MAX_ENGINES:
                time.sleep(0.5)
                sizes.append(len(members(url)))
        eventually(lambda: len(members(url)) == MAX_ENGINES, SCALE_TIMEOUT_S)
        time.sleep(AT_PEAK_S)
    finally:
        load.stop()
    eventually(lambda: len(members(url)) == 1, SCALE_TIMEOUT_S)

    assert sizes == sorted(sizes), f"the pool shrank while the load grew: {sizes}"
    assert {answer.status_code for answer in load.answers} == {200}
    assert {answer.json()["usage"]["completion_tokens"] for answer in load.answers} == {TOKENS}
    served_by = {answer.headers["x-splitserve-replica"] for answer in load.answers}
    assert len(served_by) >= MAX_ENGINES, f"every engine the pool grew takes requests: {served_by}"
