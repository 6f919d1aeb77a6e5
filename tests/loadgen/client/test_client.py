"""The client and a whole run against the fake streaming server (no engines).

Latencies are checked against what the fake server guarantees (it never sends sooner
than its TTFT and ITL) and against each other, never against an upper bound in
seconds: a slow or busy machine makes every figure longer, and must not fail a test.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest
from rich.console import Console

from loadgen.client.fake_server import FakeServerConfig, fake_server_in_thread
from loadgen.client.streaming import (
    ClientTimeouts,
    RequestRecord,
    SamplingOptions,
    StreamingClient,
    build_payload,
)
from loadgen.config import RunConfig, WorkloadConfig
from loadgen.outputs.exposition import Exposition
from loadgen.scheduling.runner import RunError, RunResult, execute_run

QUIET = Console(quiet=True)
TTFT_MS, ITL_MS = 20.0, 3.0
# asyncio may run a timer up to its clock's resolution early; this is far more than that.
CLOCK_SLACK_S = 1e-6


@pytest.fixture(scope="module")
def paced_server() -> Iterator[str]:
    config = FakeServerConfig(port=0, ttft_ms=TTFT_MS, itl_ms=ITL_MS, shape="fake-tp")
    with fake_server_in_thread(config) as url:
        yield url


def _config(url: str, **fields: object) -> RunConfig:
    base: dict[str, object] = {
        "base_url": url,
        "workload": WorkloadConfig(name="custom", input_len=64, output_len=8),
        "qps": 50.0,
        "num_requests": 20,
        "warmup_requests": 1,
        "show_progress": False,
        "server_sample_interval_s": 0.1,
    }
    base.update(fields)
    return RunConfig.model_validate(base)


async def test_run_counts_latencies_and_server_view(paced_server: str) -> None:
    exposition = Exposition()
    result = await execute_run(_config(paced_server), QUIET, exposition)
    s = result.summary
    assert (s.requests, s.completed, s.rejected, s.errors) == (20, 20, 0, 0)
    assert s.input_tokens == 20 * 64 and s.output_tokens == 20 * 8
    assert s.length_mismatches == 0
    assert s.ttft.count == 20 and s.itl.count == 20 * 7
    # Lower bounds the server sets (a slow machine only adds to them), orderings for the
    # rest: no check here assumes how much this machine adds.
    ttft_s, itl_s = TTFT_MS / 1000, ITL_MS / 1000
    for m in (m for m in result.requests if not m.warmup):
        assert m.ttft_s is not None and m.e2e_s is not None
        # The server holds the first token back TTFT_MS after it has read the request,
        # though the stream's head is out before: TTFT ends at a token, not at the head.
        assert m.ttft_s >= ttft_s - CLOCK_SLACK_S, m
        # ... and each later token ITL_MS after the one before.
        assert m.e2e_s >= ttft_s + 7 * itl_s - CLOCK_SLACK_S, m
        # The first token, then the gaps to each later one, all within the request.
        assert m.ttft_s + sum(m.itl_s) <= m.e2e_s + CLOCK_SLACK_S, m
    # The client tells the long wait for the first token from the short gaps after it.
    assert s.itl.p50 < s.ttft.p50
    assert result.shape == "fake-tp" and result.model == "fake-model"
    assert len([m for m in result.requests if m.warmup]) == 1
    # Where the router computed each prompt, from its x-splitserve-prefill header.
    assert {m.prefill for m in result.requests} == {"local:fake"}
    assert result.server.prefill_local == 20 and result.server.rejections == 0
    assert set(result.server.gpu_utilization_pct) == {"0", "1"}
    assert result.server.gpu_imbalance_pct is not None
    text = generate_latest(exposition.registry).decode()
    assert any(
        line.startswith("loadgen_time_to_first_token_seconds_count{") and 'shape="fake-tp"' in line
        for line in text.splitlines()
    )

    assert 'outcome="ok"' in text and "loadgen_inter_token_latency_seconds_bucket" in text


async def test_same_seed_same_requests_and_schedule(paced_server: str) -> None:
    first = await execute_run(_config(paced_server, seed=11), QUIET)
    second = await execute_run(_config(paced_server, seed=11), QUIET)

    def schedule(result: RunResult) -> list[float]:
        return [m.scheduled_s for m in result.requests if not m.warmup]

    assert schedule(first) == pytest.approx(schedule(second), abs=1e-9)
    assert first.workload.sizes == second.workload.sizes


async def test_max_concurrency_is_respected(paced_server: str) -> None:
    config = _config(paced_server, qps=math.inf, max_concurrency=3, num_requests=12)
    result = await execute_run(config, QUIET)
    measured = [m for m in result.requests if not m.warmup]
    events = sorted([(m.sent_s, 1) for m in measured] + [(m.done_s, -1) for m in measured])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= 3 and result.summary.completed == 12


async def test_rejections_are_counted_not_timed() -> None:
    config = FakeServerConfig(port=0, reject_every=4, reject_status=503)
    with fake_server_in_thread(config) as url:
        result = await execute_run(_config(url, warmup_requests=0), QUIET)
    s = result.summary
    assert s.rejected == 5 and s.completed == 15 and s.errors == 0
    assert s.failures_by_status == {"503": 5}
    assert s.ttft.count == 15
    assert result.server.rejections == 5


async def test_multi_token_chunks_give_token_accurate_itl() -> None:
    config = FakeServerConfig(port=0, ttft_ms=5, itl_ms=8, tokens_per_chunk=4)
    with fake_server_in_thread(config) as url:
        result = await execute_run(
            _config(url, workload=WorkloadConfig(name="custom", input_len=16, output_len=12)), QUIET
        )
    measured = [m for m in result.requests if not m.warmup]
    for m in measured:
        assert len(m.itl_s) == 11  # 12 tokens in 3 chunks of 4
        assert m.itl_s[:3] == (0.0, 0.0, 0.0)
        assert m.itl_s[3] == pytest.approx(m.itl_s[6])  # one chunk's gap spread evenly
        # vLLM's view (one gap per chunk) against ours (one per token): the same time,
        # each chunk's gap shared by its 4 tokens rather than charged to one of them.
        assert m.chunks is not None and max(m.chunks.itl_s) > 0
        assert sum(m.itl_s) == pytest.approx(sum(m.chunks.itl_s))
        assert max(m.itl_s) <= max(m.chunks.itl_s) / 4 * (1 + 1e-9)


async def test_chat_prompts_are_calibrated_to_exact_lengths(paced_server: str) -> None:
    result = await execute_run(_config(paced_server, endpoint="chat", num_requests=5), QUIET)
    assert result.chat_calibration is not None
    assert all(m.prompt_tokens == 64 for m in result.requests)
    assert result.summary.completed == 5


async def test_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(RunError, match="cannot list models"):
        await execute_run(_config("http://127.0.0.1:9"), QUIET)


async def _one_shot_server(response: bytes, delay_s: float = 0.0) -> tuple[asyncio.Server, str]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(delay_s)
        writer.write(response)
        await writer.drain()
        await asyncio.sleep(delay_s)
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _send(url: str, timeouts: ClientTimeouts | None = None) -> RequestRecord:
    client = StreamingClient(url, "completions", 2, timeouts)
    record = RequestRecord(index=0, input_len=3, output_len=2)
    payload = build_payload("completions", "m", [1, 2, 3], 2, SamplingOptions())
    try:
        await client.send(client.prepare(payload), record)
    finally:
        await client.aclose()
    return record


async def test_errors_are_counted_by_status_or_kind() -> None:
    body = b'{"error": {"message": "boom"}}'
    server, url = await _one_shot_server(
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with server:
        record = await _send(url)
    assert (record.outcome, record.status_key) == ("error", "500")
    assert "boom" in (record.error or "")

    server, url = await _one_shot_server(
        b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: 0\r\n\r\n"
    )
    async with server:
        record = await _send(url)
    assert (record.outcome, record.status_key, record.retry_after_s) == ("rejected", "429", 3.0)

    server, url = await _one_shot_server(b"", delay_s=0.5)
    async with server:
        record = await _send(url, ClientTimeouts(connect=1, read=0.1, total=5))
    assert (record.outcome, record.status_key) == ("error", "ReadTimeout")


async def test_stream_error_event_and_empty_stream_are_errors() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b'data: {"error": {"message": "engine failed"}}\n\ndata: [DONE]\n\n'
    server, url = await _one_shot_server(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    async with server:
        record = await _send(url)
    assert record.outcome == "error" and record.status_key == "StreamError"
    empty = b"data: [DONE]\n\n"
    server, url = await _one_shot_server(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(empty), empty))
    async with server:
        record = await _send(url)
    assert record.status_key == "EmptyStream"
