"""The streaming OpenAI client: one aiohttp connection pool, one timestamp per network read.

A request's JSON body is built before the run starts, so the send path does no
encoding. While a response streams, the client only stores each
read with ``time.perf_counter()``; turning reads into tokens (``loadgen.client.sse``) happens
once the stream has ended, off the timing-critical path.

Outcomes: ``ok`` (200 and a complete stream), ``rejected`` (503 or 429, the QoS
layer's answer, never a latency sample), ``error`` (any other status, a timeout, a
broken connection or an error event in the stream), counted by status or kind.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from loadgen.client.sse import read_stream
from splitserve.metric_catalogue import PREFILL_HEADER, REQUEST_ID_HEADER

Endpoint = Literal["completions", "chat"]
Outcome = Literal["pending", "ok", "rejected", "error"]
REJECTION_STATUSES = frozenset({429, 503})
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
ERROR_BODY_LIMIT = 2000
JSON_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
API_KEY_VARIABLE = "OPENAI_API_KEY"


def request_headers(
    extra: Mapping[str, str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Headers every request carries: ``Authorization: Bearer $OPENAI_API_KEY`` when the
    variable is set (as vLLM's benchmark client sends it), then ``extra`` (``--header``),
    which wins, compared without regard to case as HTTP does."""
    environ = os.environ if environ is None else environ
    headers: dict[str, str] = {}
    if api_key := environ.get(API_KEY_VARIABLE):
        headers["Authorization"] = f"Bearer {api_key}"
    for name, value in (extra or {}).items():
        for existing in [k for k in headers if k.lower() == name.lower()]:
            del headers[existing]
        headers[name] = value
    return headers


@dataclass(frozen=True)
class ClientTimeouts:
    """Seconds. ``read`` bounds each wait for the next bytes; ``total`` the whole request."""

    connect: float = 10.0
    read: float = 300.0
    total: float = 1800.0


@dataclass(slots=True)
class RequestRecord:
    """Everything the client saw of one request; absolute times are ``perf_counter``."""

    index: int
    input_len: int
    output_len: int
    warmup: bool = False
    scheduled_at: float = math.nan
    sent_at: float = math.nan
    done_at: float = math.nan
    status: int | None = None
    outcome: Outcome = "pending"
    error: str | None = None
    retry_after_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    # Reads that carried chunks (events with choices), and how many: vLLM's unit.
    event_times: list[float] = field(default_factory=list)
    event_counts: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    request_id: str | None = None  # sent as x-request-id (--request-id-prefix)
    # Where a splitserve router computed the prompt and why (``local:short_prompt``,
    # ``remote:decode_busy``): its response header, for per-request placement.
    prefill: str | None = None

    @property
    def status_key(self) -> str:
        """How an unsuccessful request is counted: its HTTP status or the failure's kind."""
        if self.status is not None and self.status != 200:
            return str(self.status)
        return (self.error or "unknown").split(":", 1)[0]


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float | None = 0.0  # None: the server's default
    ignore_eos: bool = True
    return_token_ids: bool = True
    # More body fields (vLLM's --top-p ..., --logprobs, --extra-body); they win.
    extra: Mapping[str, Any] = field(default_factory=dict)


def build_payload(
    endpoint: Endpoint,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    sampling: SamplingOptions,
) -> bytes:
    """The request body: streaming, usage at the end, fixed output length."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.temperature is not None:
        body["temperature"] = sampling.temperature
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.return_token_ids:
        body["return_token_ids"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(sampling.extra)
    return json.dumps(body, separators=(",", ":")).encode()


class StreamingClient:
    """One aiohttp session whose pool holds ``max_connections`` keep-alive connections.

    aiohttp rather than a transport of our own: on loopback it streamed as many
    requests per second as the hand-written one did (bench/loadgen_capacity.py,
    docs/DECISIONS.md), and ``iter_any`` hands over everything one network read
    brought, which is the unit this client times.
    """

    def __init__(
        self,
        base_url: str,
        endpoint: Endpoint,
        max_connections: int,
        timeouts: ClientTimeouts | None = None,
        path: str | None = None,
        headers: Mapping[str, str] | None = None,
        verify_tls: bool = True,
    ) -> None:
        """``path``: the URL path (default: the endpoint's ``/v1/...``); ``headers``: sent
        with every request (``request_headers``); ``verify_tls`` False accepts any
        certificate (vLLM's ``--insecure``)."""
        self._timeouts = timeouts or ClientTimeouts()
        self._url = base_url.rstrip("/") + (path or ENDPOINT_PATHS[endpoint])
        self._max_connections = max_connections
        self._headers = {**JSON_HEADERS, **(headers or {})}
        self._verify_tls = verify_tls
        self._session: aiohttp.ClientSession | None = None

    def prepare(self, payload: bytes) -> bytes:
        """What ``send`` takes: the encoded body (nothing else is per request)."""
        return payload

    def _open_session(self) -> aiohttp.ClientSession:
        # Created on first use: a session belongs to the event loop it was made in.
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections,
                    limit_per_host=0,
                    ssl=self._verify_tls,  # True: the default context, verifying
                ),
                # Waiting for a pooled connection is bounded by `total`, not `connect`.
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=None,
                    sock_connect=self._timeouts.connect,
                    sock_read=self._timeouts.read,
                ),
                headers=self._headers,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def send(self, payload: bytes, record: RequestRecord) -> None:
        """Send, stream, classify; never raises for what a server or network can do."""
        session = self._open_session()
        record.sent_at = time.perf_counter()
        reads: list[tuple[float, bytes]] = []
        try:
            async with asyncio.timeout(self._timeouts.total):
                await self._stream(session, payload, record, reads)
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            _fail(record, _describe_failure(error))
        record.done_at = time.perf_counter()
        if record.outcome == "pending" or reads:
            _finish_stream(record, reads)

    async def _stream(
        self,
        session: aiohttp.ClientSession,
        payload: bytes,
        record: RequestRecord,
        reads: list[tuple[float, bytes]],
    ) -> None:
        # Only requests with an id pay for headers of their own.
        headers = {REQUEST_ID_HEADER: record.request_id} if record.request_id else None
        async with session.post(self._url, data=payload, headers=headers) as response:
            record.status = response.status
            record.prefill = response.headers.get(PREFILL_HEADER)
            if response.status != 200:
                await _classify_refusal(response, record)
                return
            append = reads.append
            clock = time.perf_counter
            async for data in response.content.iter_any():
                append((clock(), data))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# The kinds a failed request is counted under (status_key), by aiohttp's exception.
_FAILURE_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (aiohttp.ConnectionTimeoutError, "ConnectTimeout"),
    (aiohttp.SocketTimeoutError, "ReadTimeout"),
    (aiohttp.ClientConnectorError, "ConnectError"),
    (aiohttp.ServerDisconnectedError, "RemoteProtocolError"),
    (aiohttp.ClientPayloadError, "RemoteProtocolError"),
    (TimeoutError, "Timeout"),
)


def _describe_failure(error: BaseException) -> str:
    kind = next((k for cls, k in _FAILURE_KINDS if isinstance(error, cls)), type(error).__name__)
    if kind == "Timeout":
        return "Timeout: no complete answer within the total timeout"
    return f"{kind}: {error or type(error).__name__}"


def _fail(record: RequestRecord, error: str) -> None:
    record.outcome = "error"
    record.error = error


async def _classify_refusal(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    body = (await response.read())[:ERROR_BODY_LIMIT].decode(errors="replace")
    if response.status in REJECTION_STATUSES:
        record.outcome = "rejected"
        record.retry_after_s = _retry_after(response.headers.get("retry-after"))
    else:
        record.outcome = "error"
    record.error = f"HTTP {response.status}: {body}"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare, and not needed for the figures


def _finish_stream(record: RequestRecord, reads: list[tuple[float, bytes]]) -> None:
    reading = read_stream(reads)
    record.chunk_times = reading.chunk_times
    record.chunk_tokens = reading.chunk_tokens
    record.event_times = reading.event_times
    record.event_counts = reading.event_counts
    record.prompt_tokens = reading.prompt_tokens
    record.completion_tokens = reading.completion_tokens
    if record.outcome != "pending":
        return
    if reading.error is not None:
        _fail(record, f"StreamError: {reading.error}")
    elif not reading.chunk_tokens:
        _fail(record, "EmptyStream: the stream ended without a token")
    else:
        record.outcome = "ok"
