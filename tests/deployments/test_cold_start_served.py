"""From the first second: a client polling while ``pd.yaml`` starts sees only "not
yet" (no connection, or 503 with Retry-After), then only answers; the first burst on
the freshly started cluster is shed by priority, high before low, refusals fast.

Statuses and orderings only, no machine-speed thresholds (bench/overload.py has the
figures): refusals answered before the first admitted token, high priority's first
tokens ahead of low priority's, nothing 5xx, no connection dropped.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import pytest

from deployments.launcher import RunningApp
from tests.support.api_corpus import assert_answers_as
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

MODEL = "splitserve-tiny-llama"
PRIORITIES = ("high", "normal", "low")
BURST = 48
PROMPT_CHARS, MAX_TOKENS = 1500, 32
POLL_S = 0.25


@dataclass
class StartupPolls:
    """What a client saw while the application started, in order."""

    completions: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    retry_after_missing: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def poll_forever(self, base_url: str) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not self.stop.is_set():
                self.completions.append(self._status(http, "POST", "/v1/completions", body))
                self.models.append(self._status(http, "GET", "/v1/models", None))
                time.sleep(POLL_S)

    def _status(self, http: httpx.Client, method: str, path: str, body: dict | None) -> str:
        try:
            response = http.request(method, path, json=body)
        except httpx.TransportError:
            return "no connection"
        if response.status_code == 503 and "retry-after" not in response.headers:
            self.retry_after_missing += 1
        return str(response.status_code)


@dataclass
class Outcome:
    priority: str
    status: int | None = None
    answered_s: float | None = None
    ttft_s: float | None = None
    stream_error: bool = False
    finish_reason: str | None = None  # of the last choice that had one
    done: bool = False  # the stream's closing ``data: [DONE]`` arrived
    failure: str | None = None  # the connection broke or timed out

    @property
    def complete(self) -> bool:
        """A whole streamed answer: its last token's finish reason, then [DONE]."""
        return self.failure is None and self.done and self.finish_reason is not None


async def _one(session: aiohttp.ClientSession, url: str, index: int) -> Outcome:
    priority = PRIORITIES[index % 3]
    outcome = Outcome(priority)
    words = " ".join(f"w{(index * 7919 + i) % 997}" for i in range(PROMPT_CHARS // 5))
    body = {
        "model": MODEL,
        "prompt": words[:PROMPT_CHARS],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={"x-priority": priority}
        ) as response:
            outcome.status = response.status
            outcome.answered_s = time.perf_counter() - started
            async for line in response.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line.removeprefix(b"data: "))
                    outcome.stream_error |= "error" in event
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - started
                    for choice in event.get("choices") or ():
                        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
                elif line.strip() == b"data: [DONE]":
                    outcome.done = True
    except (aiohttp.ClientError, TimeoutError) as error:
        # Recorded, not swallowed: a client that got its status must get its answer.
        outcome.failure = f"{type(error).__name__}: {error}"
    return outcome


async def _burst(url: str) -> list[Outcome]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        return list(await asyncio.gather(*(_one(session, url, i) for i in range(BURST))))


@pytest.fixture(scope="module")
def started(served_apps: ServedApps) -> Iterator[tuple[RunningApp, StartupPolls]]:
    """pd.yaml, polled from before its router exists until it serves (then left
    running for the modules after this one)."""
    served_apps.close()  # nothing may answer on the port before pd.yaml does
    polls = StartupPolls()
    poller = threading.Thread(
        target=polls.poll_forever, args=("http://127.0.0.1:8000",), daemon=True
    )
    poller.start()
    try:
        app = served_apps.get("pd", fresh=True)
        # A few answers after readiness, then the poller leaves the cluster cold.
        deadline = time.monotonic() + 30
        while polls.completions.count("200") < 3 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        polls.stop.set()
        poller.join(60)
        yield app, polls
    finally:
        polls.stop.set()


def test_a_client_polling_through_start_up_sees_not_yet_then_answers(
    started: tuple[RunningApp, StartupPolls],
) -> None:
    _, polls = started
    for seen in (polls.completions, polls.models):
        assert "200" in seen, seen
        first_answer = seen.index("200")
        assert set(seen[:first_answer]) <= {"no connection", "503"}, seen
        assert set(seen[first_answer:]) == {"200"}, seen
    # The router answered before its engines were up (ready means ready, not "listening").
    assert "503" in polls.completions + polls.models
    assert polls.retry_after_missing == 0


@pytest.mark.usefixtures("niced_like_ray_workers")
def test_the_first_burst_is_shed_by_priority(started: tuple[RunningApp, StartupPolls]) -> None:
    app, _ = started
    outcomes = asyncio.run(_burst(app.base_url))
    statuses = sorted({o.status for o in outcomes}, key=str)
    summary = {
        p: [(o.status, o.ttft_s and round(o.ttft_s, 2)) for o in outcomes if o.priority == p]
        for p in PRIORITIES
    }
    failures = [(o.priority, o.status, o.failure) for o in outcomes if o.failure]
    assert not failures, failures  # no connection dropped, before its status or after
    assert all(o.status in (200, 429, 503) for o in outcomes), summary
    assert not any(o.stream_error for o in outcomes), summary
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status != 200]
    assert all(o.ttft_s is not None for o in admitted), summary
    # A 200 is a promise of the whole answer: every admitted stream ran to its end.
    assert all(o.complete for o in admitted), [
        (o.priority, o.finish_reason, o.done) for o in admitted if not o.complete
    ]
    # High priority is never refused, and low priority is what gives way.
    assert all(o.status == 200 for o in outcomes if o.priority == "high"), summary
    assert any(o.priority == "low" for o in refused), (statuses, summary)
    # Refusals come back before anyone's first token: no engine was touched for them.
    first_token = min(_seconds(o.ttft_s) for o in admitted)
    assert max(_seconds(o.answered_s) for o in refused) < first_token, summary
    # High priority overtakes the queued work of the others.
    high = statistics.median(_seconds(o.ttft_s) for o in admitted if o.priority == "high")
    others = [_seconds(o.ttft_s) for o in admitted if o.priority != "high"]
    if others:
        assert high < statistics.median(others), summary


def _seconds(value: float | None) -> float:
    assert value is not None, "an answered request has its times"
    return value


def test_every_kind_of_request_is_answered_as_bare_vllm(
    started: tuple[RunningApp, StartupPolls], vllm_answers: dict[str, Any]
) -> None:
    """pd.yaml, once up: the API corpus (tests/support/api_corpus.py) as `vllm serve`."""
    assert_answers_as(vllm_answers, started[0].base_url)
