"""The router's policies end to end on ``deployments/pd.yaml`` (conditional, QoS on).

Every claim is checked twice: by the router's decision counters, and by what the
engines themselves report they computed (vLLM's prompt tokens by source, relayed as
``splitserve_engine_prompt_tokens``), so a decision that was counted but not carried
out would fail.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest

from deployments.config import load_app_config
from deployments.launcher import RunningApp, config_path
from loadgen.client.streaming import RequestRecord, SamplingOptions, StreamingClient, build_payload
from router.policies.prefill_policies import ConditionalSettings
from tests.support.greedy import metric
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

MODEL = "splitserve-tiny-llama"
CONFIG = load_app_config(config_path("pd"))


def _conditional(settings: object) -> ConditionalSettings:
    assert isinstance(settings, ConditionalSettings), "pd.yaml's prefill policy is conditional"
    return settings


POLICY = _conditional(CONFIG.prefill_policy.settings)
THRESHOLD = POLICY.prompt_length_threshold
SLO_S = CONFIG.qos.ttft_slo_s
_rng = random.Random(11)


def _prompt(length: int) -> list[int]:
    return [_rng.randrange(3, 256) for _ in range(length)]


@dataclass(frozen=True)
class Snapshot:
    """Decision counters and the engines' own prompt-token counters at one moment."""

    decisions: dict[tuple[str, str], float]
    tokens: dict[tuple[str, str], float]  # (replica, source) -> tokens

    @classmethod
    def take(cls, base_url: str) -> Snapshot:
        decisions: dict[tuple[str, str], float] = {}
        tokens: dict[tuple[str, str], float] = {}
        for row in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
            if row.startswith("splitserve_prefill_decisions_total{"):
                decisions[(_label(row, "where"), _label(row, "reason"))] = float(row.split()[-1])
            elif row.startswith("splitserve_engine_prompt_tokens{"):
                key = (_label(row, "replica"), _label(row, "source"))
                tokens[key] = float(row.split()[-1])
        return cls(decisions, tokens)

    def since(self, before: Snapshot) -> Snapshot:
        def diff(now: dict, then: dict) -> dict:
            return {k: v - then.get(k, 0.0) for k, v in now.items() if v != then.get(k, 0.0)}

        return Snapshot(diff(self.decisions, before.decisions), diff(self.tokens, before.tokens))


def _label(row: str, name: str) -> str:
    return row.split(f'{name}="', 1)[1].split('"', 1)[0]


def _settled(base_url: str, before: Snapshot, expect_decisions: int) -> Snapshot:
    """The change since ``before`` once the engines' reports have caught up (polled)."""
    deadline = time.monotonic() + 10
    last = None
    while time.monotonic() < deadline:
        change = Snapshot.take(base_url).since(before)
        decided = sum(change.decisions.values())
        if decided >= expect_decisions and change == last:
            return change
        last = change
        time.sleep(0.5)
    raise AssertionError(f"metrics did not settle: {last}")


def _complete(base_url: str, prompt: list[int], max_tokens: int = 4, **extra: object) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json={**body, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return response.status_code


ENGINES_IDLE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def pd_app(served_apps: ServedApps) -> RunningApp:
    app = served_apps.get("pd")
    _complete(app.base_url, _prompt(8))  # the first request pays for warm-up
    _wait_engines_idle(app.base_url)
    return app


def _wait_engines_idle(base_url: str) -> None:
    """Until the router's last stats of every engine show nothing running or waiting: an
    app that an earlier module flooded reads as busy until its next stats poll, and the
    prefill policy would send these tests' short prompts remote as 'decode_busy'."""
    deadline = time.monotonic() + ENGINES_IDLE_WAIT_S
    while (busy := metric(base_url, "splitserve_engine_requests")) > 0:
        assert time.monotonic() < deadline, f"engines still report {busy:g} requests"
        time.sleep(0.2)


def test_short_prompt_is_prefilled_by_the_decode_replica(pd_app: RunningApp) -> None:
    before = Snapshot.take(pd_app.base_url)
    _complete(pd_app.base_url, _prompt(THRESHOLD // 4))
    change = _settled(pd_app.base_url, before, 1)
    assert change.decisions == {("local", "short_prompt"): 1}
    assert change.tokens.get(("decode-0", "local_compute"), 0) >= THRESHOLD // 4
    assert not any(replica == "prefill-0" for replica, _ in change.tokens)


def test_long_prompt_goes_remote_and_its_prefix_then_stays_local(pd_app: RunningApp) -> None:
    long_prompt = _prompt(4 * THRESHOLD)
    before = Snapshot.take(pd_app.base_url)
    _complete(pd_app.base_url, long_prompt)
    change = _settled(pd_app.base_url, before, 1)
    assert change.decisions == {("remote", "long_prompt"): 1}
    assert change.tokens.get(("prefill-0", "local_compute"), 0) >= 4 * THRESHOLD - 1
    assert change.tokens.get(("decode-0", "external_kv_transfer"), 0) >= 4 * THRESHOLD - 1

    # Same long prefix, a short new tail: the decode replica holds the prefix (it cached
    # the blocks it loaded), so what is left to compute is short and stays local.
    follow_up = [*long_prompt, *_prompt(THRESHOLD // 4)]
    before = Snapshot.take(pd_app.base_url)
    _complete(pd_app.base_url, follow_up)
    change = _settled(pd_app.base_url, before, 1)
    assert change.decisions == {("local", "prefix_cached"): 1}
    assert change.tokens.get(("decode-0", "local_cache_hit"), 0) >= 3 * THRESHOLD
    assert change.tokens.get(("decode-0", "local_compute"), 0) < THRESHOLD
    assert not any(replica == "prefill-0" for replica, _ in change.tokens)
    # What the router knew of the decode replica's cache agreed with what vLLM found: by
    # the signal it routed by, and by the engine's own KV events relayed to it (blocks
    # loaded from another engine are stored blocks too).
    tokens = "splitserve_prefix_cache_tokens_total"
    reported = metric(pd_app.base_url, tokens, source="reported")
    assert metric(pd_app.base_url, tokens, source="estimated") == reported > 0
    assert metric(pd_app.base_url, tokens, source="kv_events") == reported
    errors = "splitserve_prefix_estimate_error_tokens_count"
    assert metric(pd_app.base_url, errors, signal="kv_events") >= 2


def test_a_busy_prefill_pool_sends_long_prompts_local(pd_app: RunningApp) -> None:
    queue_max = POLICY.prefill_queue_max
    burst = 3 * queue_max
    prompts = [_prompt(4 * THRESHOLD) for _ in range(burst)]
    before = Snapshot.take(pd_app.base_url)
    with ThreadPoolExecutor(burst) as pool:
        statuses = list(pool.map(lambda p: _complete(pd_app.base_url, p, max_tokens=2), prompts))
    assert statuses == [200] * burst
    change = _settled(pd_app.base_url, before, burst)
    # Local because the pool is full by count, or (QoS on) because its queue already
    # puts the first token past the objective while the decode replica is sooner.
    local = sum(
        change.decisions.get(("local", r), 0) for r in ("prefill_queue_full", "remote_too_slow")
    )
    remote = change.decisions.get(("remote", "long_prompt"), 0)
    assert local >= 1 and local + remote == burst, change.decisions
    # The decode engine really computed the prompts sent local.
    computed_locally = change.tokens.get(("decode-0", "local_compute"), 0)
    assert computed_locally >= local * (4 * THRESHOLD - 1), change.tokens


# ---- QoS under overload -----------------------------------------------------------------

OVERLOAD_FACTOR = 3
OVERLOAD_SECONDS = 20
HIGH_SHARE = 0.15  # the rest is low priority: what admission control may shed
# Long enough prompts that three times the sustained rate is a rate one client process
# (niced like the cluster) really sends.
PROMPT_LEN, OUTPUT_LEN = 8 * THRESHOLD, 16
# "Fast" on two cores that the refused requests' own HTTP handling shares with both
# engines: well under the objective, and measured by the client, proxy hop included.
FAST_REFUSAL_S = 0.5
MIN_OFFERED_FACTOR = 2.5  # what the client must have achieved for this to be an overload


@dataclass
class Outcome:
    priority: str
    status: int | None  # None: no answer, or a broken one (must not happen)
    ttft_s: float | None
    elapsed_s: float
    retry_after_s: float | None = None


def _payload() -> bytes:
    sampling = SamplingOptions(return_token_ids=False)
    return build_payload("completions", MODEL, _prompt(PROMPT_LEN), OUTPUT_LEN, sampling)


def _outcome(priority: str, record: RequestRecord) -> Outcome:
    ttft = record.chunk_times[0] - record.sent_at if record.chunk_times else None
    elapsed = record.done_at - record.sent_at
    # A 200 whose stream broke or ended without its tokens is no answer.
    broken = record.outcome == "error" and record.status == 200
    status = None if broken else record.status
    return Outcome(priority, status, ttft, elapsed, record.retry_after_s)


@asynccontextmanager
async def _clients(base_url: str) -> AsyncIterator[dict[str, StreamingClient]]:
    """The load generator's own client, one per priority (sent as the x-priority header).
    Not httpx: its connection pool, at the flood's 40-50 requests a second, queued
    requests in the client for seconds (a probe from another process saw the server
    answer high priority in under a second meanwhile), and the test read that as the
    server's TTFT (docs/DECISIONS.md, "The overload test's client")."""
    clients = {
        priority: StreamingClient(base_url, "completions", 0, headers={"x-priority": priority})
        for priority in ("high", "low")
    }
    try:
        yield clients
    finally:
        for client in clients.values():
            await client.aclose()


async def _send(client: StreamingClient, priority: str, payload: bytes) -> Outcome:
    record = RequestRecord(index=0, input_len=PROMPT_LEN, output_len=OUTPUT_LEN)
    await client.send(payload, record)
    return _outcome(priority, record)


async def _sustained_rate(base_url: str) -> float:
    """Requests a second the cluster completes with a steady backlog of high priority."""
    payloads = [_payload() for _ in range(32)]
    async with _clients(base_url) as clients:
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(_send(clients["high"], "high", p) for p in payloads))
    assert all(o.status == 200 for o in outcomes), outcomes
    return len(outcomes) / (time.perf_counter() - started)


def _overload_schedule(rate: float) -> list[tuple[float, str, bytes]]:
    """Poisson arrivals over OVERLOAD_SECONDS: (offset, priority, body), bodies encoded
    before the flood so that sending does no encoding."""
    rng = random.Random(5)
    schedule, at = [], 0.0
    while at < OVERLOAD_SECONDS:
        priority = "high" if rng.random() < HIGH_SHARE else "low"
        schedule.append((at, priority, _payload()))
        at += rng.expovariate(rate)
    return schedule


async def _overload(base_url: str, rate: float) -> list[Outcome]:
    schedule = _overload_schedule(rate)
    async with _clients(base_url) as clients:
        tasks = []
        started = time.perf_counter()
        for offset, priority, payload in schedule:
            # On a schedule, not a sleep after each send: the loop's own work between
            # sends (streams of earlier requests) would add up.
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            tasks.append(asyncio.create_task(_send(clients[priority], priority, payload)))
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)


@pytest.mark.usefixtures("niced_like_ray_workers")
def test_overload_sheds_low_priority_and_keeps_high_within_slo(pd_app: RunningApp) -> None:
    sustained = asyncio.run(_sustained_rate(pd_app.base_url))
    outcomes = asyncio.run(_overload(pd_app.base_url, OVERLOAD_FACTOR * sustained))
    offered = len(outcomes) / OVERLOAD_SECONDS
    high = [o for o in outcomes if o.priority == "high"]
    low = [o for o in outcomes if o.priority == "low"]
    high_ttft = sorted(o.ttft_s for o in high if o.ttft_s is not None)
    p95 = high_ttft[int(0.95 * (len(high_ttft) - 1))] if high_ttft else float("inf")
    summary = (
        f"sustained {sustained:.1f} req/s, sent {len(outcomes)} at {OVERLOAD_FACTOR}x:"
        f" high {_statuses(high)}, TTFT p95 {p95:.3f} s, low {_statuses(low)};"
        f" prefills {_decisions(pd_app.base_url)}"
    )
    print(summary)
    assert offered >= MIN_OFFERED_FACTOR * sustained, f"the client fell behind; {summary}"
    # Every request got an answer: a completion or a refusal, never silence.
    assert all(o.status in (200, 429, 503) for o in outcomes), summary
    assert all(o.status == 200 for o in high), summary
    assert p95 < SLO_S, summary
    refused = [o for o in low if o.status == 503]
    assert refused, f"no low-priority request was shed at {OVERLOAD_FACTOR}x load; {summary}"
    assert all(o.retry_after_s is not None for o in refused)
    refusal_p95 = sorted(o.elapsed_s for o in refused)[int(0.95 * (len(refused) - 1))]
    assert refusal_p95 < FAST_REFUSAL_S, f"refusals took {refusal_p95:.3f} s at p95"
    assert metric(pd_app.base_url, "splitserve_rejections_total", priority="low") >= len(refused)
    # Nothing is left running once the answers are in.
    deadline = time.monotonic() + 20
    while metric(pd_app.base_url, "splitserve_engine_requests", state="unfinished") > 0:
        assert time.monotonic() < deadline, "engines still hold requests after the overload"
        time.sleep(0.5)


def _decisions(base_url: str) -> dict[tuple[str, str], float]:
    return Snapshot.take(base_url).decisions


def _statuses(outcomes: list[Outcome]) -> str:
    counts: dict[int | None, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    median = f", TTFT p50 {statistics.median(ttfts):.3f} s" if ttfts else ""
    return f"{counts}{median}"
