"""The router's HTTP API, spoken over real HTTP (ASGI, in this process) to its FastAPI
app with one synthetic engine: every status it answers, OpenAI's error body, SSE
framing, its headers, readiness, QoS and API-key refusals (tests/support/in_process_router.py).
No Ray cluster and no vLLM engine: a synthetic engine gives every running request one
token (text "a", the prompt's last token id) per step, ``engine.step_interval_s`` apart.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from engines.synthetic import SyntheticEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from router.lifecycle import RequestLife
from router.pool.pooled_engine import LocalEngineLink
from tests.support.in_process_router import (
    CHAT,
    COMPLETIONS,
    PROMPT,
    http_client,
    in_process_router,
    kill_engine,
    metric,
    only_model,
    openai_error,
    ready,
    sse_events,
    until,
)

# An engine whose steps come 5 s apart: a request's first token comes at once when the
# engine is idle, else at its next step; with calibration off, nothing runs before.
SLOW_ENGINE: dict[str, Any] = {"backend": "synthetic", "step_interval_s": 5.0}
NO_CALIBRATION = {"calibration_prompt_tokens": 0}
IMAGE = {"url": "http://example.com/a.png"}


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"model": EMBEDDED_MODEL_NAME, "messages": messages, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **fields}


def _host(router: Any, name: str) -> SyntheticEngineHost:
    """The synthetic engine the in-process router hosts as ``name``."""
    link = only_model(router).pool.get(name).link
    assert isinstance(link, LocalEngineLink) and isinstance(link._host, SyntheticEngineHost)
    return link._host


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """HTTP to a router with the default settings and one synthetic engine."""
    async with in_process_router() as router, http_client(router) as served:
        yield served


@pytest.fixture
async def engine_start(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[threading.Event]:
    """Synthetic engines that finish starting once the test sets this event (set at the
    end in any case, while the event loop still runs: it waits for their threads)."""
    started = threading.Event()
    construct = SyntheticEngineHost.__init__

    def held(host: SyntheticEngineHost, spec: Any) -> None:
        started.wait(5)  # bounded: a failing test must not hang the engine's thread
        construct(host, spec)

    monkeypatch.setattr(SyntheticEngineHost, "__init__", held)
    yield started
    started.set()


# ---- 200 ------------------------------------------------------------------------------------


async def test_a_chat_completion_is_one_json_body_with_the_engines_tokens(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(CHAT, json=chat(), headers={"x-request-id": "chat-1"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-splitserve-replica"] == "engine-0"
    body = response.json()
    assert (body["id"], body["object"], body["model"]) == (
        "chatcmpl-chat-1",
        "chat.completion",
        EMBEDDED_MODEL_NAME,
    )
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "aaaa"},
            "finish_reason": "length",
        }
    ]
    usage = body["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 4


async def test_a_completion_returns_its_tokens_and_token_ids_when_asked(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(COMPLETIONS, json=completion(return_token_ids=True))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "text": "aaaa",
            "finish_reason": "length",
            "token_ids": [7, 7, 7, 7],
            "prompt_token_ids": PROMPT,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


# ---- SSE ------------------------------------------------------------------------------------


async def test_a_chat_stream_opens_with_the_role_and_ends_with_usage_then_done(
    client: httpx.AsyncClient,
) -> None:
    body = chat(stream=True, stream_options={"include_usage": True})
    response = await client.post(CHAT, json=body, headers={"x-request-id": "stream-1"})
    assert response.status_code == 200
    assert response.headers["x-splitserve-replica"] == "engine-0"
    events = sse_events(response)
    assert {event["id"] for event in events} == {"chatcmpl-stream-1"}
    assert {event["object"] for event in events} == {"chat.completion.chunk"}
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    tokens = [event["choices"] for event in events[1:-1]]
    assert tokens == [[{"index": 0, "delta": {"content": "a"}}]] * 3 + [
        [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}]
    ]
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_completion_stream_has_one_text_chunk_per_token_and_usage_only_if_asked(
    client: httpx.AsyncClient, include_usage: bool
) -> None:
    body = completion(
        max_tokens=3,
        stream=True,
        return_token_ids=True,
        stream_options={"include_usage": include_usage},
    )
    events = sse_events(await client.post(COMPLETIONS, json=body))
    assert {event["object"] for event in events} == {"text_completion"}
    chunks = [event["choices"][0] for event in events[:3]]
    assert [(c["text"], c["token_ids"], c.get("finish_reason")) for c in chunks] == [
        ("a", [7], None),
        ("a", [7], None),
        ("a", [7], "length"),
    ]
    # The prompt's ids come once, with the first token.
    assert [c.get("prompt_token_ids") for c in chunks] == [PROMPT, None, None]
    if include_usage:
        assert len(events) == 4 and events[3]["choices"] == []
        assert events[3]["usage"]["total_tokens"] == 6
    else:
        assert len(events) == 3 and all("usage" not in event for event in events)


# ---- 400, 404, 413 ----------------------------------------------------------------------------


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
IMAGE_MESSAGE = {"role": "user", "content": [{"type": "image_url", "image_url": IMAGE}]}


@pytest.mark.parametrize(
    ("route", "body", "headers", "param", "says"),
    [
        pytest.param(CHAT, b'{"model": ', {}, None, "malformed JSON", id="malformed-json"),
        pytest.param(CHAT, b"[1, 2]", {}, None, "must be a JSON object", id="not-an-object"),
        pytest.param(CHAT, chat(max_tokens="four"), {}, "max_tokens", "integer", id="wrong-type"),
        pytest.param(CHAT, chat(messages="hi"), {}, "messages", "must be a list", id="messages"),
        pytest.param(
            CHAT,
            chat(messages=[IMAGE_MESSAGE]),
            {},
            None,
            "is not a multimodal model",
            id="image",
        ),
        pytest.param(
            CHAT,
            chat(tools=[TOOL], tool_choice="required"),
            {},
            None,
            "--tool-call-parser",
            id="required-tool-without-a-parser",
        ),
        pytest.param(
            CHAT,
            chat(max_tokens=5000),
            {},
            "max_tokens",
            "maximum context length is 4096 tokens",
            id="past-the-context",
        ),
        pytest.param(
            CHAT, chat(chat_template="{{ 1 }}"), {}, "chat_template", "refused", id="template"
        ),
        pytest.param(
            CHAT,
            chat(priority="urgent"),
            {},
            "priority",
            "priority must be one of high, normal, low",
            id="priority-field",
        ),
        pytest.param(
            CHAT,
            chat(),
            {"x-priority": "urgent"},
            "priority",
            "x-priority header must be one of",
            id="priority-header",
        ),
    ],
)
async def test_a_bad_request_is_a_400_naming_the_parameter(
    client: httpx.AsyncClient,
    route: str,
    body: dict[str, Any] | bytes,
    headers: dict[str, str],
    param: str | None,
    says: str,
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post(route, content=content, headers=headers)
    assert says in openai_error(response, 400, "BadRequestError", param)
    assert "x-splitserve-replica" not in response.headers  # no engine was asked


@pytest.mark.parametrize(
    ("route", "body", "check"),
    [
        pytest.param(
            CHAT, chat(n=2), lambda b: [c["index"] for c in b["choices"]] == [0, 1], id="n"
        ),
        pytest.param(
            CHAT,
            chat(logprobs=True, top_logprobs=1),
            lambda b: len(b["choices"][0]["logprobs"]["content"]) == 4,
            id="chat-logprobs",
        ),
        pytest.param(
            COMPLETIONS,
            completion(prompt="hello", echo=True),
            lambda b: b["choices"][0]["text"] == "hello" + "a" * 4,
            id="echo",
        ),
        pytest.param(
            COMPLETIONS,
            completion(prompt="hello", prompt_logprobs=0),
            lambda b: len(b["choices"][0]["prompt_logprobs"]) == 5,
            id="prompt-logprobs",
        ),
        pytest.param(
            COMPLETIONS,
            completion(prompt=["a", "b"]),
            lambda b: [c["text"] for c in b["choices"]] == ["aaaa", "aaaa"],
            id="batched-prompts",
        ),
        pytest.param(
            CHAT,
            chat(use_beam_search=True, n=2),
            # A synthetic engine gives one candidate per step: one beam survives.
            lambda b: b["usage"]["completion_tokens"] == 4,
            id="beam-search",
        ),
        pytest.param(
            "/v1/responses",
            {"model": EMBEDDED_MODEL_NAME, "input": "hi", "max_output_tokens": 4},
            lambda b: b["output"][0]["content"][0]["text"] == "aaaa",
            id="responses",
        ),
        pytest.param(
            "/tokenize",
            {"model": EMBEDDED_MODEL_NAME, "prompt": "hello"},
            lambda b: b["tokens"] == list(b"hello"),
            id="tokenize",
        ),
        pytest.param(
            "/detokenize",
            {"model": EMBEDDED_MODEL_NAME, "tokens": list(b"hello")},
            lambda b: b["prompt"] == "hello",
            id="detokenize",
        ),
    ],
)
async def test_what_only_vllms_layer_renders_is_served_through_the_dispatch(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], check: Any
) -> None:
    response = await client.post(route, content=json.dumps(body).encode())
    assert response.status_code == 200, response.text
    assert check(response.json()), response.text
    if route != "/tokenize" and route != "/detokenize":
        assert response.headers["x-splitserve-replica"] == "engine-0"


async def test_a_stream_through_vllms_layer_carries_every_completion(
    client: httpx.AsyncClient,
) -> None:
    body = completion(n=2, stream=True, logprobs=1)
    response = await client.post(COMPLETIONS, content=json.dumps(body).encode())
    assert response.status_code == 200
    by_index: dict[int, str] = {}
    for chunk in sse_events(response):
        for choice in chunk["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
            assert len(choice["logprobs"]["tokens"]) == 1
    assert by_index == {0: "aaaa", 1: "aaaa"}


async def test_unknown_fields_are_ignored_unless_the_router_rejects_them() -> None:
    body = chat(max_tokens=1, frobnicate=True)
    async with in_process_router() as router, http_client(router) as client:
        assert (await client.post(CHAT, json=body)).status_code == 200
    reject = {"router": {"unknown_fields": "reject"}}
    async with in_process_router(**reject) as router, http_client(router) as client:
        response = await client.post(CHAT, json=body)
        message = openai_error(response, 400, "BadRequestError", "frobnicate")
        assert message == "unrecognized request argument: 'frobnicate'"


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "image_url", "image_url": {}}])
async def test_a_malformed_content_part_is_a_400(
    client: httpx.AsyncClient, part: dict[str, Any]
) -> None:
    # vLLM's models validate content parts only as the router iterates them (a 500 once).
    response = await client.post(CHAT, json=chat(messages=[{"role": "user", "content": [part]}]))
    message = openai_error(response, 400, "BadRequestError", "messages.0.content")
    assert message.startswith("messages[0]: invalid content part")


async def test_an_unknown_model_is_a_404(client: httpx.AsyncClient) -> None:
    response = await client.post(CHAT, json=chat(model="gpt-4"))
    assert openai_error(response, 404, "NotFoundError", "model") == (
        f"The model 'gpt-4' does not exist; this server serves '{EMBEDDED_MODEL_NAME}'."
    )


async def test_a_path_the_router_does_not_serve_is_an_openai_404(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/embeddings", json={"input": "hi"})
    assert openai_error(response, 404, "NotFoundError", None) == (
        "POST /v1/embeddings: no such route on this server"
    )


async def test_a_method_a_route_does_not_take_is_an_openai_405_naming_the_allowed_one(
    client: httpx.AsyncClient,
) -> None:
    response = await client.get(COMPLETIONS)
    assert openai_error(response, 405, "MethodNotAllowedError", None) == (
        f"GET {COMPLETIONS}: the route does not take this method"
    )
    assert response.headers["allow"] == "POST"


async def _in_pieces(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 1000):
        yield body[start : start + 1000]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
async def test_a_body_past_max_request_bytes_is_a_413(declared: bool) -> None:
    body = json.dumps(chat("a" * 5000)).encode()
    content = body if declared else _in_pieces(body)
    async with (
        in_process_router(router={"max_request_bytes": 4096}) as router,
        http_client(router) as client,
    ):
        response = await client.post(CHAT, content=content)
        message = openai_error(response, 413, "RequestTooLargeError", None)
        assert "larger than the 4096 bytes" in message and "router.max_request_bytes" in message
        small = await client.post(CHAT, json=chat("a" * 100))
        assert small.status_code == 200


# ---- 500, 503, 504: the engine ---------------------------------------------------------------


async def test_an_engine_failure_before_the_first_token_is_a_500(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ready(client)  # calibrated before the engine starts failing

    async def failing(host: SyntheticEngineHost, request: Any) -> None:
        raise RuntimeError("out of KV blocks")

    monkeypatch.setattr(SyntheticEngineHost, "submit", failing)
    response = await client.post(CHAT, json=chat())
    message = openai_error(response, 500, "InternalServerError", None)
    assert message == "the engine replica failed (engine-0): out of KV blocks"


async def test_a_dead_engine_is_a_503_with_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    async with (
        in_process_router(router={"submit_timeout_s": 2}) as router,
        http_client(router) as client,
    ):
        await ready(client)
        kill_engine(router, "engine-0", monkeypatch)
        response = await client.post(CHAT, json=chat())
        message = openai_error(response, 503, "ServiceUnavailableError", None)
        assert message.startswith("the engine replica is unavailable (engine-0)")
        assert response.headers["retry-after"] == "2"  # router.submit_timeout_s


async def test_a_request_past_request_timeout_s_is_a_504_and_aborted_in_the_engine() -> None:
    args = {"engine": SLOW_ENGINE, "qos": NO_CALIBRATION, "router": {"request_timeout_s": 0.3}}
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        started = time.monotonic()
        response = await client.post(COMPLETIONS, json=completion())  # one token, then 5 s
        assert time.monotonic() - started < 2
        message = openai_error(response, 504, "TimeoutError", None)
        assert "router.request_timeout_s (0.3 s) on engine-0; it was aborted" in message
        engine = _host(router, "engine-0")
        await until(lambda: engine.stats().num_running == 0, timeout_s=1)


async def test_a_stream_that_times_out_before_its_first_token_is_a_504_status() -> None:
    args = {"engine": SLOW_ENGINE, "qos": NO_CALIBRATION, "router": {"request_timeout_s": 0.3}}
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        # The engine takes its 5 s pause after this one's step: the next waits for it.
        assert (await client.post(COMPLETIONS, json=completion(max_tokens=1))).status_code == 200
        response = await client.post(CHAT, json=chat(stream=True))
        openai_error(response, 504, "TimeoutError", None)


async def test_an_error_after_the_first_token_is_an_error_event_in_the_stream() -> None:
    args = {"engine": SLOW_ENGINE, "qos": NO_CALIBRATION, "router": {"request_timeout_s": 1.0}}
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        response = await client.post(CHAT, json=chat(stream=True))  # one token, then 5 s
        assert response.status_code == 200
        role, token, error = sse_events(response)
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert token["choices"][0]["delta"] == {"content": "a"}
        assert set(error) == {"error"}
        assert (error["error"]["type"], error["error"]["code"]) == ("TimeoutError", 504)
        assert "router.request_timeout_s" in error["error"]["message"]


# ---- readiness --------------------------------------------------------------------------------


async def test_health_and_models_are_503_while_the_engine_starts_then_200(
    engine_start: threading.Event,
) -> None:
    async with in_process_router() as router, http_client(router) as client:
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "starting",
            "router": "in-process",
            "replicas": {"engine-0": "starting"},
        }
        models = await client.get("/v1/models")
        message = openai_error(models, 503, "ServiceUnavailableError", None)
        assert message == "the model is not ready yet: engine-0 starting; retry"
        assert models.headers["retry-after"] == "5"  # router.ready_wait_s
        engine_start.set()
        await ready(client)
        assert (await client.get("/health")).json()["replicas"] == {"engine-0": "ok"}
        assert (await client.get("/v1/models")).status_code == 200


async def test_a_request_while_starting_waits_ready_wait_s_then_gets_a_503(
    engine_start: threading.Event,
) -> None:
    async with (
        in_process_router(router={"ready_wait_s": 0.3}) as router,
        http_client(router) as client,
    ):
        started = time.monotonic()
        response = await client.post(CHAT, json=chat())
        assert time.monotonic() - started >= 0.3
        message = openai_error(response, 503, "ServiceUnavailableError", None)
        assert message == "the model is not ready yet: engine-0 starting; retry"
        assert response.headers["retry-after"] == "1"


async def test_a_request_held_while_starting_is_served_once_the_engine_is_ready(
    engine_start: threading.Event,
) -> None:
    async with in_process_router() as router, http_client(router) as client:
        held = asyncio.create_task(client.post(CHAT, json=chat()))
        await asyncio.sleep(0.2)
        assert not held.done()  # waiting, within router.ready_wait_s (5 s)
        engine_start.set()
        response = await held
        assert response.status_code == 200
        assert response.json()["choices"][0]["message"]["content"] == "aaaa"


# ---- QoS --------------------------------------------------------------------------------------


async def test_a_priority_past_its_ttft_limit_is_refused_early_with_503_and_retry_after() -> None:
    # Calibration measures the 0.3 s step: every estimate is at least that, over low's 0.1 s.
    args = {
        "engine": {"backend": "synthetic", "step_interval_s": 0.3},
        "qos": {"enabled": True, "early_rejection_s": {"low": 0.1}, "retry_after_s": 7},
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        for body, headers in (
            (chat(max_tokens=1), {"x-priority": "low"}),
            (chat(max_tokens=1, priority="low"), {"x-priority": "high"}),  # the body's wins
        ):
            response = await client.post(CHAT, json=body, headers=headers)
            message = openai_error(response, 503, "ServiceUnavailableError", None)
            assert "exceeds the 0.1 s allowed for low priority" in message
            assert response.headers["retry-after"] == "7"
        served = await client.post(CHAT, json=chat(max_tokens=1), headers={"x-priority": "high"})
        assert served.status_code == 200
        rejected = await metric(client, "splitserve_rejections_total", reason="ttft_slo")
        assert rejected == 2


async def test_a_priority_past_its_queue_cap_is_a_429_with_retry_after() -> None:
    args = {
        "engine": SLOW_ENGINE,
        "router": {"request_timeout_s": 1.0},
        "qos": {
            **NO_CALIBRATION,
            "enabled": True,
            "queue_caps": {"high": 2, "normal": 1, "low": 1},
            "retry_after_s": 3,
        },
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        assert (await client.post(COMPLETIONS, json=completion(max_tokens=1))).status_code == 200
        waiting = asyncio.create_task(client.post(CHAT, json=chat()))  # for the next step
        await until(lambda: only_model(router).lifecycle.dispatcher.queued_requests() == 1)
        for priority in ("normal", "low"):
            response = await client.post(CHAT, json=chat(), headers={"x-priority": priority})
            message = openai_error(response, 429, "RateLimitError", None)
            assert f"too many requests waiting (1, the cap for {priority} priority is 1)" in message
            assert response.headers["retry-after"] == "3"
        # High's cap is 2: admitted, it waits with the first, and both time out.
        high = await client.post(CHAT, json=chat(), headers={"x-priority": "high"})
        assert (high.status_code, (await waiting).status_code) == (504, 504)
        assert await metric(client, "splitserve_rejections_total", reason="queue_full") == 2


# ---- API keys over HTTP (tests/router/http/test_auth.py has the rest) ---------------------------

TEAM_KEY = "sk-team-0123456789"
BATCH_KEY = "sk-batch-0123456789"
AUTH = {
    "retry_after_s": 2,
    "keys": [
        {"name": "team", "key": TEAM_KEY, "max_queued": 1},
        {"name": "batch", "key": BATCH_KEY, "routes": [COMPLETIONS]},
    ],
}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_keys_are_checked_before_the_body_is_read_or_parsed() -> None:
    large = json.dumps(chat("a" * 5000)).encode()
    async with (
        in_process_router(auth=AUTH, router={"max_request_bytes": 4096}) as router,
        http_client(router) as client,
    ):
        for body in (large, b'{"model": '):
            response = await client.post(CHAT, content=body)
            assert "missing API key" in openai_error(response, 401, "AuthenticationError", None)
            assert response.headers["www-authenticate"] == "Bearer"
        refused = await client.post(CHAT, content=large, headers=bearer(BATCH_KEY))
        message = openai_error(refused, 403, "PermissionDeniedError", None)
        assert message == f"the API key 'batch' may not call {CHAT}"
        admitted = await client.post(CHAT, content=large, headers=bearer(TEAM_KEY))
        assert admitted.status_code == 413  # past the key, the body's own limit
        served = await client.post(COMPLETIONS, json=completion(), headers=bearer(BATCH_KEY))
        assert served.status_code == 200


async def test_open_paths_answer_without_a_key_over_http() -> None:
    auth = {**AUTH, "open_paths": ["/health", "/metrics", "/v1/models"]}
    async with in_process_router(auth=auth) as router, http_client(router) as client:
        await ready(client)
        for path in ("/health", "/metrics", "/v1/models"):
            assert (await client.get(path)).status_code == 200
        assert (await client.post(COMPLETIONS, json=completion())).status_code == 401


async def test_a_keys_queue_cap_is_a_429_with_auths_retry_after() -> None:
    args = {
        "auth": AUTH,
        "engine": SLOW_ENGINE,
        "qos": NO_CALIBRATION,
        "router": {"request_timeout_s": 1.0},
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        team = bearer(TEAM_KEY)
        warm = await client.post(COMPLETIONS, json=completion(max_tokens=1), headers=team)
        assert warm.status_code == 200  # its place came back with its first token
        waiting = asyncio.create_task(client.post(CHAT, json=chat(), headers=team))
        await until(lambda: only_model(router).lifecycle.dispatcher.queued_requests() == 1)
        response = await client.post(CHAT, json=chat(), headers=team)
        message = openai_error(response, 429, "RateLimitError", None)
        assert "the API key 'team' already has 1 requests waiting" in message
        assert response.headers["retry-after"] == "2"  # auth.retry_after_s
        assert (await waiting).status_code == 504
        rejections = "splitserve_rejections_total"
        assert await metric(client, rejections, team, reason="key_queue_full") == 1


# Bad input of every kind the served shapes once each checked on real engines
# (tests/deployments/test_shapes_served.py): its status, type and param, the same
# whatever the shape, since the router answers it before any engine is asked.
M = EMBEDDED_MODEL_NAME
SHAPE_INDEPENDENT_BAD_REQUESTS = [
    (COMPLETIONS, b"{not json", 400, None),
    (COMPLETIONS, b"[1, 2]", 400, None),
    (COMPLETIONS, {"model": M, "max_tokens": 3}, 400, "prompt"),
    (COMPLETIONS, {"model": M, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (COMPLETIONS, {"model": M, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    (COMPLETIONS, {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    (COMPLETIONS, {"model": M, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    (COMPLETIONS, {"model": M, "prompt": [1] * 4096, "max_tokens": 1}, 400, "prompt"),
    (COMPLETIONS, {"model": M, "prompt": [1, 2, 100000]}, 400, "prompt"),
    (COMPLETIONS, {"model": M, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"model": M, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": M, "messages": []}, 400, "messages"),
    (CHAT, {"model": M}, 400, "messages"),
    (
        CHAT,
        {
            "model": M,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        None,  # vLLM's layer renders it: "... is not a multimodal model"
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), SHAPE_INDEPENDENT_BAD_REQUESTS)
async def test_bad_input_of_any_shape_gets_the_openai_error(
    client: httpx.AsyncClient, route: str, body: Any, status: int, param: str | None
) -> None:
    await ready(client)  # vLLM's layer, which renders some of these, is built by then
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = await client.post(route, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (status, param) and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_the_openai_client_raises_typed_errors(client: httpx.AsyncClient) -> None:
    await ready(client)
    openai_client = openai.AsyncOpenAI(
        base_url=f"{str(client.base_url).rstrip('/')}/v1",
        api_key="unused",
        http_client=client,  # type: ignore[arg-type]  # openai types its own httpx
        max_retries=0,
    )
    with pytest.raises(openai.NotFoundError):
        await openai_client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await openai_client.completions.create(model=M, prompt="hi", max_tokens=10_000)


# ---- headers, /v1/models, /metrics ------------------------------------------------------------


async def test_a_request_id_is_echoed_and_names_the_response(client: httpx.AsyncClient) -> None:
    sent = await client.post(COMPLETIONS, json=completion(), headers={"x-request-id": "abc-1"})
    assert sent.headers["x-request-id"] == "abc-1" and sent.json()["id"] == "cmpl-abc-1"
    made = await client.post(CHAT, json=chat())  # Serve's middleware gives one
    assert made.json()["id"] == f"chatcmpl-{made.headers['x-request-id']}"
    refused = await client.post(CHAT, content=b"{", headers={"x-request-id": "bad-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-1"


async def test_models_lists_the_served_model(client: httpx.AsyncClient) -> None:
    await ready(client)
    response = await client.get("/v1/models")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        EMBEDDED_MODEL_NAME,
        "model",
        "splitserve",
        4096,
    )


async def test_the_router_adopts_the_context_its_engines_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset, max_model_len is what vLLM derives in the engine (on GPUs, the model's
    own, which may differ from the config's max_position_embeddings); the router takes
    the engines' figure before it admits anything, and refuses what they would."""
    stats = SyntheticEngineHost.stats

    def reporting(host: SyntheticEngineHost) -> Any:
        return msgspec.structs.replace(stats(host), max_model_len=1000)

    monkeypatch.setattr(SyntheticEngineHost, "stats", reporting)
    async with in_process_router() as router, http_client(router) as client:
        await ready(client)
        card = (await client.get("/v1/models")).json()["data"][0]
        assert card["max_model_len"] == 1000
        over = await client.post(COMPLETIONS, json=completion(max_tokens=999))
        assert over.status_code == 400 and "maximum context length is 1000" in over.text


async def test_metrics_are_prometheus_text_counting_requests_by_status(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post(CHAT, json=chat())).status_code == 200
    assert (await client.post(CHAT, json=chat(model="gpt-4"))).status_code == 404
    response = await client.get("/metrics")
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    requests = "splitserve_requests_total"
    assert await metric(client, requests, route=CHAT, status="200", priority="normal") == 1
    assert await metric(client, requests, route=CHAT, status="404") == 1
    assert await metric(client, "splitserve_replica_requests_total", replica="engine-0") == 1
    assert await metric(client, "splitserve_tokens_total", kind="generation") == 4


# ---- statuses through vLLM's serving layer ------------------------------------------------------


async def test_through_vllms_layer_a_qos_refusal_keeps_its_503_and_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = {
        "engine": {"backend": "synthetic", "step_interval_s": 0.3},
        "qos": {"enabled": True, "early_rejection_s": {"low": 0.1}, "retry_after_s": 7},
    }
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        # Past the early check (no queue yet), refused once planned: in generate.
        monkeypatch.setattr(RequestLife, "admit_early", lambda life: None)
        for stream in (False, True):
            body = chat(max_tokens=1, n=2, stream=stream)
            response = await client.post(CHAT, json=body, headers={"x-priority": "low"})
            message = openai_error(response, 503, "ServiceUnavailableError", None)
            assert "exceeds the 0.1 s allowed for low priority" in message
            assert response.headers["retry-after"] == "7"


async def test_through_vllms_layer_a_timeout_is_a_504_and_aborted_in_the_engine() -> None:
    args = {"engine": SLOW_ENGINE, "qos": NO_CALIBRATION, "router": {"request_timeout_s": 0.3}}
    async with in_process_router(**args) as router, http_client(router) as client:
        await ready(client)
        response = await client.post(COMPLETIONS, json=completion(n=2))  # one step, then 5 s
        message = openai_error(response, 504, "TimeoutError", None)
        assert "router.request_timeout_s (0.3 s)" in message
        engine = _host(router, "engine-0")
        await until(lambda: engine.stats().num_running == 0, timeout_s=1)


async def test_through_vllms_layer_a_failed_engine_is_a_500_naming_it(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ready(client)

    async def failing(host: SyntheticEngineHost, request: Any) -> None:
        raise RuntimeError("out of KV blocks")

    monkeypatch.setattr(SyntheticEngineHost, "submit", failing)
    response = await client.post(CHAT, json=chat(logprobs=True))
    message = openai_error(response, 500, "InternalServerError", None)
    assert message == "the engine replica failed (engine-0): out of KV blocks"


async def test_through_vllms_layer_a_client_that_leaves_frees_the_engine() -> None:
    async with in_process_router() as router, http_client(router) as client:
        await ready(client)
        body = completion(n=2, max_tokens=3000, stream=True)
        async with client.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    break  # the client leaves after its first event
        replica = only_model(router).pool.get("engine-0")
        await until(lambda: replica.state.in_flight == 0 and not _host(router, "engine-0")._running)


async def test_through_vllms_layer_the_pools_engine_limits_hold() -> None:
    # A pool that lets its engines return 30 logprobs per token: vLLM's layer in the
    # router checks requests against the same limit, not vLLM's default of 20.
    pools = [{"engine_kwargs": {"max_logprobs": 30}}]
    async with in_process_router(pools=pools) as router, http_client(router) as client:
        await ready(client, timeout_s=60)
        taken = await client.post(COMPLETIONS, json=completion(logprobs=25))
        assert taken.status_code == 200, taken.text
        refused = await client.post(COMPLETIONS, json=completion(logprobs=31))
        assert refused.status_code == 400
        assert "30" in refused.json()["error"]["message"]
