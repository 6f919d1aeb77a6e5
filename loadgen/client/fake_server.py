"""A tiny OpenAI-compatible streaming server: the load generator's own test bench.

It answers ``/v1/completions`` and ``/v1/chat/completions`` (streaming or not) with
made-up tokens at a configurable pace (zero by default), plus ``/v1/models``,
``/health`` and a ``/metrics`` page shaped like the splitserve router's. It is written
on raw asyncio protocols, not a web framework, so that on loopback it is much faster
than any client it serves: the capacity benchmark measures the client, not the server.

    python -m loadgen fake-server --port 8100 --ttft-ms 20 --itl-ms 5
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from pydantic import Field

from loadgen.scheduling.eventloop import run_event_loop
from splitserve import metric_catalogue as catalogue
from splitserve.config_base import StrictModel
from splitserve.metric_catalogue import PREFILL_HEADER, register

FAKE_MODEL_NAME = "fake-model"
MAX_HEADER_BYTES = 64 * 1024
# Byte-level tokens, like the embedded model's tokenizer: token id = byte value.
TOKEN_ID_MODULUS = 256
FIRST_PRINTABLE = 32
RENDERED_CACHE_SIZE = 4096
# The emulated gauges: each in-flight stream keeps a "GPU" this busy, and the KV cache
# holds this many full contexts.
BUSY_PERCENT_PER_STREAM = 25.0
KV_CAPACITY_CONTEXTS = 8


class FakeServerConfig(StrictModel):
    """How the fake server behaves; every delay is per request, never shared."""

    host: str = "127.0.0.1"
    port: int = Field(8100, ge=0, le=65535)
    model: str = FAKE_MODEL_NAME
    max_model_len: int = Field(4096, gt=0)
    ttft_ms: float = Field(0.0, ge=0, description="Delay before the first token.")
    itl_ms: float = Field(0.0, ge=0, description="Delay between chunks after the first.")
    tokens_per_chunk: int = Field(1, ge=1, description="Tokens carried by each stream chunk.")
    reject_every: int = Field(
        0, ge=0, description="Answer every Nth generation request with 503 (0: never)."
    )
    reject_status: int = Field(503, description="Status of rejected requests (503 or 429).")
    retry_after_s: int = Field(1, ge=0)
    max_concurrent: int = Field(
        0,
        ge=0,
        description="Paced streams served at once (0: no limit); the rest wait in line, so"
        " TTFT grows with load: a known capacity of max_concurrent / (ttft + (n-1) itl)"
        " requests a second, for the goodput search's tests.",
    )
    shape: str = Field("fake", description="The 'shape' label of the emulated router metrics.")
    required_headers: dict[str, str] = Field(
        default_factory=dict,
        description="Headers every /v1 request must carry (names without regard to case),"
        " else 401: to test --header and $OPENAI_API_KEY.",
    )
    gpus: int = Field(2, ge=0, description="Emulated GPUs in splitserve_gpu_utilization_percent.")


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    # As a splitserve router says where it computed the prompt.
    + PREFILL_HEADER.encode()
    + b": local:fake\r\ntransfer-encoding: chunked\r\n\r\n"
)


class _Metrics:
    """The subset of the router's metrics that the load generator's server view reads."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        model = config.model
        self.requests = register(catalogue.REQUESTS, r)
        self.rejections = register(catalogue.REJECTIONS, r).labels(model, "queue_full", "normal")
        self.prefill = register(catalogue.PREFILL_DECISIONS, r).labels(model, "local", "fake")
        self.kv_usage = register(catalogue.ENGINE_KV_CACHE_USAGE, r).labels(
            model, "fake-0", "mixed"
        )
        self.gpu = register(catalogue.UTILIZATION["gpu"], r)
        # The router labels its latency histograms with its shape; so does this one. The
        # fake counts its streams there, untimed.
        self.served = register(catalogue.E2E, r).labels(model, config.shape)
        self.in_flight = 0
        self.gpus = config.gpus
        self.max_model_len = config.max_model_len

    def update_gauges(self, kv_tokens: int) -> None:
        # A made-up but load-dependent picture: GPU 0 busier than the others.
        busy = min(100.0, BUSY_PERCENT_PER_STREAM * self.in_flight)
        for gpu in range(self.gpus):
            self.gpu.labels("fake-0", "mixed", str(gpu)).set(busy / (gpu + 1))
        capacity = KV_CAPACITY_CONTEXTS * self.max_model_len
        self.kv_usage.set(min(1.0, kv_tokens / capacity))


@dataclass
class _ServerState:
    config: FakeServerConfig
    metrics: _Metrics
    generation_requests: int = 0
    kv_tokens: int = 0
    # Zero-latency streams depend only on the request's size: render each size once.
    rendered: dict[tuple[object, ...], bytes] = field(default_factory=dict)
    _slots: asyncio.Semaphore | None = None

    def slot(self) -> contextlib.AbstractAsyncContextManager[object]:
        """A place among ``max_concurrent`` streams (or none to wait for)."""
        if self.config.max_concurrent <= 0:
            return contextlib.nullcontext()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrent)
        return self._slots


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: int, body: bytes, content_type: str, extra: str = "") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}.get(
        status, "Service Unavailable" if status == 503 else "Error"
    )
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def _json_response(status: int, payload: Any, extra: str = "") -> bytes:
    return _response(status, json.dumps(payload).encode(), "application/json", extra)


def _error(status: int, message: str, extra: str = "") -> bytes:
    body = {"error": {"message": message, "type": "fake_error", "code": status}}
    return _json_response(status, body, extra)


class _Generation:
    """One generation request's events, rendered as OpenAI SSE lines."""

    def __init__(self, state: _ServerState, payload: dict[str, Any], chat: bool) -> None:
        self.chat = chat
        self.model = state.config.model
        self.stream = bool(payload.get("stream"))
        self.include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        self.return_token_ids = bool(payload.get("return_token_ids"))
        self.max_tokens = int(payload.get("max_tokens") or 16)
        self.prompt_tokens = _prompt_tokens(payload, chat)
        self.per_chunk = state.config.tokens_per_chunk

    def token_chunks(self) -> list[list[int]]:
        ids = [
            FIRST_PRINTABLE + i % (TOKEN_ID_MODULUS - FIRST_PRINTABLE)
            for i in range(self.max_tokens)
        ]
        return [ids[i : i + self.per_chunk] for i in range(0, len(ids), self.per_chunk)]

    def event(self, token_ids: list[int], last: bool) -> bytes:
        text = bytes(token_ids).decode("latin-1")
        finish = '"length"' if last else "null"
        ids = f',"token_ids":{json.dumps(token_ids)}' if self.return_token_ids else ""
        if self.chat:
            choice = (
                f'{{"index":0,"delta":{{"content":{json.dumps(text)}}}'
                f',"finish_reason":{finish}{ids}}}'
            )
            kind = "chat.completion.chunk"
        else:
            choice = f'{{"index":0,"text":{json.dumps(text)},"finish_reason":{finish}{ids}}}'
            kind = "text_completion"
        return (
            f'data: {{"id":"fake","object":"{kind}","created":0,"model":"{self.model}",'
            f'"choices":[{choice}]}}\n\n'
        ).encode()

    def opening(self) -> bytes | None:
        if not self.chat:
            return None
        return (
            f'data: {{"id":"fake","object":"chat.completion.chunk","created":0,'
            f'"model":"{self.model}","choices":[{{"index":0,"delta":{{"role":"assistant",'
            f'"content":""}}}}]}}\n\n'
        ).encode()

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.max_tokens,
            "total_tokens": self.prompt_tokens + self.max_tokens,
        }

    def closing(self) -> bytes:
        tail = b""
        if self.include_usage:
            usage = json.dumps({"id": "fake", "choices": [], "usage": self.usage()})
            tail = f"data: {usage}\n\n".encode()
        return tail + b"data: [DONE]\n\n"

    def cache_key(self) -> tuple[object, ...]:
        return (
            self.chat,
            self.max_tokens,
            self.prompt_tokens,
            self.include_usage,
            self.return_token_ids,
        )

    def full_body(self) -> dict[str, Any]:
        text = "".join(bytes(c).decode("latin-1") for c in self.token_chunks())
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": "fake", "model": self.model, "choices": [choice], "usage": self.usage()}


def _prompt_tokens(payload: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = payload.get("messages") or []
        return sum(len(str(m.get("content", "")).encode()) for m in messages)
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).encode())


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests on it are answered in order."""

    def __init__(self, state: _ServerState) -> None:
        self._state = state
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._queue: list[_Request] = []
        self._busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while request := self._next_request():
            self._queue.append(request)
        if not self._busy:
            self._drain()

    def _next_request(self) -> _Request | None:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEADER_BYTES:
                self._write(_error(400, "headers too large"))
                self._close()
            return None
        method, path, headers = _parse_head(bytes(self._buffer[:end]))
        length = int(headers.get("content-length", "0"))
        if len(self._buffer) < end + 4 + length:
            return None
        body = bytes(self._buffer[end + 4 : end + 4 + length])
        del self._buffer[: end + 4 + length]
        return _Request(method, path.split("?", 1)[0], headers, body)

    def _drain(self) -> None:
        while self._queue and self._transport is not None:
            request = self._queue.pop(0)
            pending = self._handle(request)
            if pending is not None:
                # A paced stream: answer the rest of the queue once it is finished.
                self._busy = True
                task = asyncio.get_running_loop().create_task(pending)
                task.add_done_callback(self._resume)
                return

    def _resume(self, _task: asyncio.Task[None]) -> None:
        self._busy = False
        self._drain()

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _handle(self, request: _Request) -> Any:
        routes: dict[tuple[str, str], Callable[[_Request], Any]] = {
            ("POST", "/v1/completions"): lambda r: self._generate(r, chat=False),
            ("POST", "/v1/chat/completions"): lambda r: self._generate(r, chat=True),
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): lambda r: self._write(_json_response(200, {"status": "ok"})),
            ("GET", "/metrics"): self._metrics_page,
        }
        handler = routes.get((request.method, request.path))
        if handler is None:
            self._write(_error(404, f"no route {request.method} {request.path}"))
            return None
        if request.path.startswith("/v1/") and (missing := self._missing_header(request)):
            self._write(_error(401, f"missing or wrong header {missing}"))
            return None
        return handler(request)

    def _missing_header(self, request: _Request) -> str | None:
        for name, value in self._state.config.required_headers.items():
            if request.headers.get(name.lower()) != value:
                return name
        return None

    def _models(self, _request: _Request) -> None:
        config = self._state.config
        # `root` as vLLM's server has it: vLLM's benchmark client reads it.
        card = {
            "id": config.model,
            "object": "model",
            "root": config.model,
            "max_model_len": config.max_model_len,
        }
        self._write(_json_response(200, {"object": "list", "data": [card]}))

    def _metrics_page(self, _request: _Request) -> None:
        metrics = self._state.metrics
        metrics.update_gauges(self._state.kv_tokens)
        body = generate_latest(metrics.registry)
        self._write(_response(200, body, "text/plain; version=0.0.4"))

    def _generate(self, request: _Request, chat: bool) -> Any:
        state = self._state
        route = request.path
        state.generation_requests += 1
        every = state.config.reject_every
        if every and state.generation_requests % every == 0:
            status = state.config.reject_status
            state.metrics.requests.labels(state.config.model, route, str(status), "normal").inc()
            state.metrics.rejections.inc()
            extra = f"retry-after: {state.config.retry_after_s}\r\n"
            self._write(_error(status, "rejected by the fake admission control", extra))
            return None
        try:
            generation = _Generation(state, json.loads(request.body), chat)
        except (ValueError, TypeError) as error:
            state.metrics.requests.labels(state.config.model, route, "400", "normal").inc()
            self._write(_error(400, f"bad request: {error}"))
            return None
        state.metrics.requests.labels(state.config.model, route, "200", "normal").inc()
        state.metrics.prefill.inc()
        state.metrics.served.observe(0.0)
        if not generation.stream:
            self._write(_json_response(200, generation.full_body()))
            return None
        config = state.config
        if config.ttft_ms == 0 and config.itl_ms == 0:
            key = generation.cache_key()
            stream = state.rendered.get(key)
            if stream is None:
                if len(state.rendered) >= RENDERED_CACHE_SIZE:
                    state.rendered.clear()
                stream = state.rendered[key] = self._whole_stream(generation)
            self._write(stream)
            return None
        return self._paced_stream(generation)

    def _whole_stream(self, generation: _Generation) -> bytes:
        parts = [STREAM_HEAD]
        if opening := generation.opening():
            parts.append(_chunk(opening))
        chunks = generation.token_chunks()
        for index, ids in enumerate(chunks):
            parts.append(_chunk(generation.event(ids, index == len(chunks) - 1)))
        parts.append(_chunk(generation.closing()))
        parts.append(b"0\r\n\r\n")
        return b"".join(parts)

    async def _paced_stream(self, generation: _Generation) -> None:
        state = self._state
        state.metrics.in_flight += 1
        state.kv_tokens += generation.prompt_tokens + generation.max_tokens
        async with state.slot():
            await self._pace(generation)

    async def _pace(self, generation: _Generation) -> None:
        state = self._state
        config = state.config
        try:
            self._write(STREAM_HEAD)
            if opening := generation.opening():
                self._write(_chunk(opening))
            await asyncio.sleep(config.ttft_ms / 1000)
            chunks = generation.token_chunks()
            for index, ids in enumerate(chunks):
                if index:
                    await asyncio.sleep(config.itl_ms / 1000)
                if self._transport is None:
                    return  # the client went away
                self._write(_chunk(generation.event(ids, index == len(chunks) - 1)))
            self._write(_chunk(generation.closing()) + b"0\r\n\r\n")
        finally:
            state.metrics.in_flight -= 1
            state.kv_tokens -= generation.prompt_tokens + generation.max_tokens


async def serve_fake(config: FakeServerConfig, ready: asyncio.Event | None = None) -> None:
    """Serve until cancelled; ``ready`` is set once the socket listens."""
    state = _ServerState(config=config, metrics=_Metrics(config))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Connection(state), config.host, config.port, reuse_address=True, backlog=4096
    )
    if ready is not None:
        ready.set()
    async with server:
        await server.serve_forever()


def run_fake_server(config: FakeServerConfig) -> None:
    """Blocking entry point for ``python -m loadgen fake-server``; stops on SIGINT/SIGTERM."""

    async def main() -> None:
        task = asyncio.create_task(serve_fake(config))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        print(f"fake server on http://{config.host}:{config.port} (model {config.model})")
        with contextlib.suppress(asyncio.CancelledError):
            await task

    run_event_loop(main())


@contextlib.contextmanager
def fake_server_in_thread(config: FakeServerConfig) -> Iterator[str]:
    """Run the fake server on a background thread's loop; yields its base URL.

    Port 0 picks a free port. For tests and benchmarks inside one process.
    """
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        state = _ServerState(config=config, metrics=_Metrics(config))
        server = await loop.create_server(
            lambda: _Connection(state), config.host, config.port, reuse_address=True
        )
        holder["task"] = asyncio.current_task()
        holder["port"] = server.sockets[0].getsockname()[1]
        started.set()
        async with server:
            await server.serve_forever()

    thread = threading.Thread(
        target=lambda: _run_until_cancelled(loop, main()), name="fake-server", daemon=True
    )
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the fake server did not start")
    try:
        yield f"http://{config.host}:{holder['port']}"
    finally:
        loop.call_soon_threadsafe(holder["task"].cancel)
        thread.join(10)


def _run_until_cancelled(loop: asyncio.AbstractEventLoop, coroutine: Any) -> None:
    asyncio.set_event_loop(loop)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(coroutine)
    pending = asyncio.all_tasks(loop)  # streams still being paced out
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
