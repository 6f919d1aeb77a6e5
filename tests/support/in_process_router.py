"""The router's own class in this process, its engines synthetic ones beside it: the
whole request path (auth, limits, validation, tokenization, dispatch, responses)
without Ray or vLLM engines. Routes are called as methods with a Starlette Request,
which is what FastAPI hands them inside Serve, or over real HTTP: ``http_client``
speaks to the router's FastAPI app through ASGI, in this process.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.serve._private.http_util import RequestIdMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from deployments.app import engine_names, engine_spec
from deployments.config import AppConfig, parse_app_config
from engines.settings import EngineBackendConfig
from engines.synthetic import SyntheticEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from kv_transfer import make_kv_backend
from router import runtime
from router.http import ingress
from router.http.ingress import Router
from router.http.served_model import ServedModel
from router.pool.pooled_engine import LocalEngineLink
from router.settings import ModelBinding
from tests.support.fake_engine import RecordingKV

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = [5, 6, 7]  # a synthetic engine answers with the last prompt token, 7, each step
# The router's headers as clients read them, spelled out: a rename must fail the tests.
REPLICA = "x-splitserve-replica"
PREFILL = "x-splitserve-prefill"
PREFILL_REPLICA = "x-splitserve-prefill-replica"

# serve.ingress wraps the class; the class itself comes next.
ROUTER_CLASS: type = Router.__mro__[1]


def _servable_dependency() -> Callable[..., Any]:
    """What serve.ingress made every route's ``self``: a FastAPI dependency that asks
    Serve's replica context for the replica's instance (ray/serve/_private/http_util.py,
    make_fastapi_class_based_view)."""
    for route in ingress.app.routes:
        endpoint = getattr(route, "endpoint", None)
        if endpoint is not None and "self" in inspect.signature(endpoint).parameters:
            return inspect.signature(endpoint).parameters["self"].default.dependency
    raise RuntimeError("no route of router.http.ingress.app takes the Router instance")


SERVABLE_DEPENDENCY = _servable_dependency()


def http_request(
    path: str, body: bytes = b"", headers: dict[str, str] | None = None, method: str = "POST"
) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    return Request(scope, receive)


@dataclass
class Sent:
    """What a response sent over ASGI: its status, headers and whole body."""

    status_code: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def answer(route: Callable[[Request], Awaitable[Response]], request: Request) -> Sent:
    """What ``route`` (a method of the router) sends for ``request``: a route's response
    makes its answer as it is sent (router/http/life_response.py)."""
    return await sent(await route(request))


async def sent(response: Response) -> Sent:
    """``response`` as a server sends it over ASGI."""
    out = Sent()

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            out.status_code = message["status"]
            out.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            out.body += message.get("body", b"")

    await response({"type": "http", "method": "POST", "path": "/"}, receive, send)
    return out


def chat_body(content: str = "hi", **fields: Any) -> bytes:
    return json.dumps(
        {
            "model": EMBEDDED_MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            **fields,
        }
    ).encode()


class _RecordingKVBackend:
    """The KV backend a PD router gets here: Ray's object store would need a cluster,
    and synthetic engines move no KV; it records what the router releases."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def router_side(self) -> RecordingKV:
        return RecordingKV()


def _config(args: dict[str, Any]) -> AppConfig:
    """The application's config; for shape pd with its synthetic engines, which the
    config refuses there (they move no KV, so a real deployment could not hand over)."""
    if args["shape"] != "pd" or args["engine"].get("backend") != "synthetic":
        return parse_app_config(args)
    engine = EngineBackendConfig.model_validate(args["engine"])
    config = parse_app_config({key: value for key, value in args.items() if key != "engine"})
    return config.model_copy(update={"engine": engine})


def only_model(router: Any) -> ServedModel:
    """The one model an in-process router serves: its pool, dispatcher and KV."""
    (served,) = router._models.values()
    return served


@asynccontextmanager
async def in_process_router(**args: Any) -> AsyncIterator[Any]:
    """A started router with synthetic engines; ``args``: YAML args beside or instead
    of the defaults (shape single, one pool, synthetic engines): ``router``, ``auth``,
    ``qos``, ``engine`` (e.g. ``step_interval_s``), ``shape`` and ``pools`` for dp
    (``[{"replicas": 2}]``) or pd (``[{"role": "prefill"}, {"role": "decode"}]``, with
    a KV backend that records releases in ``router._kv``)."""
    config = _config({"shape": "single", "pools": [{}], "engine": {"backend": "synthetic"}, **args})
    names = engine_names(config)
    specs = {name: engine_spec(config, name, pool, index) for name, pool, index in names}
    roles: dict[str, str] = {name: pool.role for name, pool, _ in names}
    binding = ModelBinding(config.ingress_settings(), roles, local_engines=specs)
    router: Any = object.__new__(ROUTER_CLASS)
    # Simulated engines hand over with a KV backend of their own, which needs no cluster.
    recorded = config.engine.backend == "synthetic"
    with mock.patch.object(
        runtime, "make_kv_backend", _RecordingKVBackend if recorded else make_kv_backend
    ):
        await ROUTER_CLASS.__init__(router, [binding])  # type: ignore[misc]  # Serve awaits it
    try:
        yield router
    finally:
        router.__del__()
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ReplicaContext:
    """The part of Serve's replica context the router reads (/health names it)."""

    class replica_id:
        unique_id = "in-process"


@asynccontextmanager
async def http_client(router: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of ``router``: the router's FastAPI app (``router.http.ingress.app``,
    its routes as serve.ingress rewrote them) with ``router`` as every route's ``self``,
    behind Serve's RequestIdMiddleware as both of Serve's entry points (its proxy and
    direct ingress) put it; over ASGI in this process, without a socket.

    httpx's ASGI transport hands over a response once it has ended: a stream's events
    arrive together, each as the router framed it."""
    app = ingress.app

    async def this_router() -> Any:  # async: a plain function would run in a thread
        return router

    app.dependency_overrides[SERVABLE_DEPENDENCY] = this_router
    transport = httpx.ASGITransport(app=RequestIdMiddleware(app))
    try:
        with mock.patch.object(ingress.serve, "get_replica_context", _ReplicaContext):
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                yield client
    finally:
        app.dependency_overrides.pop(SERVABLE_DEPENDENCY, None)


# ---- reading what came back ------------------------------------------------------------------


def sse_events(response: httpx.Response) -> list[Any]:
    """A stream's events, each checked to be framed ``data: <one line>\\n\\n``, its
    JSON parsed; the stream must end with ``data: [DONE]``, which is left off."""
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    text = response.text
    assert text.endswith("\n\n"), f"an unterminated event: {text[-80:]!r}"
    frames = text.split("\n\n")[:-1]
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, f"not an SSE data event: {frame!r}"
    assert frames and frames[-1] == "data: [DONE]", f"no [DONE] at the end: {frames[-1:]}"
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]


def openai_error(response: httpx.Response, status: int, kind: str, param: str | None) -> str:
    """The error's message, once the response is checked to be exactly OpenAI's error
    body (JSON) with this status, type and param."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == (
        kind,
        param,
        status,
    )
    return str(body["error"]["message"])


async def metric(
    client: httpx.AsyncClient, name: str, headers: dict[str, str] | None = None, **labels: str
) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``, from /metrics."""
    response = await client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def ready(client: httpx.AsyncClient, timeout_s: float = 5.0) -> None:
    """Wait until /health answers 200: every engine up, calibrated and healthy."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await client.get("/health")).status_code != 200:
        assert asyncio.get_running_loop().time() < deadline, "the router never became ready"
        await asyncio.sleep(0.01)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds; fail after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


def kill_engine(router: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The synthetic engine of replica ``name`` dies: it says it is dead, as a vLLM engine
    host whose engine processes are gone does. Its link then fails every call as
    unavailable and, after LocalEngineLink's grace, starts a new engine in its place."""
    monkeypatch.setattr(
        SyntheticEngineHost, "dead", property(lambda host: getattr(host, "killed", False))
    )
    link = only_model(router).pool.get(name).link
    assert isinstance(link, LocalEngineLink)
    link._host.killed = True  # type: ignore[union-attr]  # a SyntheticEngineHost, killed
