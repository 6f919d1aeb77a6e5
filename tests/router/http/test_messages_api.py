"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over the
router's dispatch, spoken over ASGI to the router's FastAPI app with one synthetic engine
(each step a token, text "a"): vLLM's Anthropic serving class renders it, the router
admits, plans and relays it as every other request, and its errors, the router's own
included, are in Anthropic's format. (Every shape against bare ``vllm serve``:
tests/support/api_corpus.py; Anthropic's SDK against real engines:
tests/deployments/test_shapes_served.py.)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engines.tiny_model import EMBEDDED_MODEL_NAME
from router.http.auth import KEYS_ENV
from tests.support.in_process_router import REPLICA, http_client, in_process_router, metric

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]
KEY = "sk-anthropic-client-0123456789"


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with in_process_router() as router, http_client(router) as served:
        yield served


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    """The message, once the body is checked to be exactly Anthropic's error format."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """A Messages stream's (event name, data) pairs, each frame checked to be both."""
    assert response.headers["content-type"].startswith("text/event-stream")
    found = []
    for frame in response.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        found.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return found


async def test_a_message_is_answered_through_the_dispatch(client: httpx.AsyncClient) -> None:
    response = await client.post(MESSAGES, json=messages(system="Be brief."))
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["type"], body["role"], body["model"]) == (
        "message",
        "assistant",
        EMBEDDED_MODEL_NAME,
    )
    assert body["content"] == [{"type": "text", "text": "aaaa"}]
    assert body["stop_reason"] == "max_tokens"
    assert body["usage"]["output_tokens"] == 4 and body["usage"]["input_tokens"] > 0
    assert response.headers[REPLICA] == "engine-0"


async def test_a_streamed_message_is_anthropics_event_sequence(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post(MESSAGES, json=messages(stream=True))
    assert response.status_code == 200, response.text
    sent = events(response)
    names = [name for name, _ in sent if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in sent)
    text = "".join(data["delta"]["text"] for name, data in sent if name == "content_block_delta")
    assert text == "aaaa"
    final = next(data for name, data in sent if name == "message_delta")
    assert final["delta"]["stop_reason"] == "max_tokens"
    assert final["usage"]["output_tokens"] == 4


async def test_count_tokens_counts_the_rendered_prompt_without_an_engine(
    client: httpx.AsyncClient,
) -> None:
    short = await client.post(COUNT_TOKENS, json={"model": EMBEDDED_MODEL_NAME, "messages": USER})
    longer = await client.post(
        COUNT_TOKENS,
        json={"model": EMBEDDED_MODEL_NAME, "messages": USER, "system": "Answer in one word."},
    )
    assert short.status_code == longer.status_code == 200, short.text
    # The embedded tokenizer is byte-level: the system prompt adds its bytes at least.
    assert longer.json()["input_tokens"] >= short.json()["input_tokens"] + len(
        "Answer in one word."
    )
    assert REPLICA not in short.headers


async def test_the_routers_own_errors_are_in_anthropics_format(
    client: httpx.AsyncClient,
) -> None:
    unknown = await client.post(MESSAGES, json=messages(model="claude-17"))
    assert "'claude-17' does not exist" in anthropic_error(unknown, 404, "NotFoundError")
    malformed = await client.post(MESSAGES, content=b"{not json")
    assert "malformed JSON" in anthropic_error(malformed, 400, "BadRequestError")
    no_max_tokens = await client.post(
        MESSAGES, json={"model": EMBEDDED_MODEL_NAME, "messages": USER}
    )
    assert "max_tokens" in anthropic_error(no_max_tokens, 400, "BadRequestError")


async def test_vllms_errors_on_the_messages_routes_are_in_anthropics_format(
    client: httpx.AsyncClient,
) -> None:
    # Past the context: vLLM's own check, translated as vLLM's Anthropic routes do.
    response = await client.post(MESSAGES, json=messages(max_tokens=10**7))
    anthropic_error(response, 400, "BadRequestError")


async def test_messages_are_counted_by_route_as_every_request(client: httpx.AsyncClient) -> None:
    await client.post(MESSAGES, json=messages())
    await client.post(MESSAGES, json=messages(model="claude-17"))
    name = "splitserve_requests_total"
    ok = await metric(client, name, route=MESSAGES, priority="normal", status="200")
    unknown = await metric(client, name, route=MESSAGES, priority="normal", status="404")
    assert (ok, unknown) == (1, 1)


@pytest.fixture
def anthropic_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEYS_ENV, KEY)


async def test_a_key_is_taken_from_x_api_key_as_anthropics_clients_send_it(
    anthropic_key: None,
) -> None:
    async with in_process_router() as router, http_client(router) as client:
        missing = await client.post(MESSAGES, json=messages())
        assert "x-api-key" in anthropic_error(missing, 401, "AuthenticationError")
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await client.post(MESSAGES, json=messages(), headers={"x-api-key": "sk-no"})
        anthropic_error(wrong, 401, "AuthenticationError")
        served = await client.post(MESSAGES, json=messages(), headers={"x-api-key": KEY})
        assert served.status_code == 200, served.text
        bearer = {"authorization": f"Bearer {KEY}"}
        assert (await client.post(MESSAGES, json=messages(), headers=bearer)).status_code == 200
