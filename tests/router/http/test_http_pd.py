"""PD over HTTP, in this process: a synthetic prefill engine and a synthetic decode
engine behind one router (shape pd), with a KV side that records releases in place
of Ray's object store (tests/support/in_process_router.py). Synthetic engines move no
KV, so what is checked is the router's part: where each prompt runs, what each engine
is asked, the headers that say so, and that a request outlives its prefill replica.
tests/router/test_pd_flow.py has the flow's branches against fake links, and
tests/deployments/test_pd_served.py the real hand-over between vLLM engines (serving).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engines.protocol import CONTINUE_FROM, GenerateRequest
from engines.synthetic import SyntheticEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.in_process_router import (
    CHAT,
    COMPLETIONS,
    PREFILL,
    PREFILL_REPLICA,
    PROMPT,
    REPLICA,
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


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": EMBEDDED_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **fields}


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[GenerateRequest]]:
    """The requests each engine was given, by replica name; calibration's left out."""
    requests: dict[str, list[GenerateRequest]] = defaultdict(list)
    submit = SyntheticEngineHost.submit

    async def recording(host: SyntheticEngineHost, request: GenerateRequest) -> None:
        if not request.request_id.startswith("calibration-"):
            requests[host._spec.name].append(request)
        await submit(host, request)

    monkeypatch.setattr(SyntheticEngineHost, "submit", recording)
    return requests


@asynccontextmanager
async def pd(mode: str = "always", **args: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """A ready PD router whose prefill policy is ``mode``, and an HTTP client of it."""
    pools = [{"role": "prefill"}, {"role": "decode"}]
    split = {"name": mode}
    async with (
        in_process_router(shape="pd", pools=pools, prefill_policy=split, **args) as router,
        http_client(router) as client,
    ):
        await ready(client)
        yield router, client


async def test_a_remote_prefill_names_both_replicas_and_hands_its_token_to_decode(
    submitted: dict[str, list[GenerateRequest]],
) -> None:
    async with pd() as (_, client):
        response = await client.post(COMPLETIONS, json=completion(return_token_ids=True))
        assert response.status_code == 200
        assert (
            response.headers[REPLICA],
            response.headers[PREFILL_REPLICA],
            response.headers[PREFILL],
        ) == ("decode-0", "prefill-0", "remote:always")
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["token_ids"]) == ("aaaa", [7, 7, 7, 7])
        (prefill,) = submitted["prefill-0"]
        assert (prefill.prompt_token_ids, prefill.sampling_params.max_tokens) == (PROMPT, 1)
        assert prefill.kv_transfer_params is not None
        assert prefill.kv_transfer_params["do_remote_decode"] is True
        (decode,) = submitted["decode-0"]
        # The same request, continuing from the first token (forced on the decode engine).
        assert decode.prompt_token_ids == PROMPT
        assert decode.sampling_params.max_tokens == 4
        assert decode.sampling_params.extra_args == {CONTINUE_FROM: [7]}
        assert decode.kv_transfer_params == {"do_remote_prefill": True}
        decisions = "splitserve_prefill_decisions_total"
        assert await metric(client, decisions, where="remote", reason="always") == 1


async def test_a_pd_stream_is_framed_as_any_other_with_its_headers() -> None:
    async with pd() as (_, client):
        body = {
            "model": EMBEDDED_MODEL_NAME,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        response = await client.post(CHAT, json=body)
        assert (response.headers[PREFILL_REPLICA], response.headers[PREFILL]) == (
            "prefill-0",
            "remote:always",
        )
        events = sse_events(response)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [event["choices"][0]["delta"]["content"] for event in events[1:5]] == ["a"] * 4
        assert events[4]["choices"][0]["finish_reason"] == "length"
        assert events[5]["choices"] == [] and events[5]["usage"]["completion_tokens"] == 4


async def test_never_prefills_on_the_decode_replica_and_says_so(
    submitted: dict[str, list[GenerateRequest]],
) -> None:
    async with pd("never") as (_, client):
        response = await client.post(COMPLETIONS, json=completion())
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "aaaa"
        assert (response.headers[REPLICA], response.headers[PREFILL]) == ("decode-0", "local:never")
        assert PREFILL_REPLICA not in response.headers
        assert submitted["prefill-0"] == []
        assert [request.prompt_token_ids for request in submitted["decode-0"]] == [PROMPT]


async def test_an_unhealthy_prefill_pool_means_a_local_prefill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pd(router={"stats_interval_s": 0.02}) as (router, client):
        kill_engine(router, "prefill-0", monkeypatch)
        await until(lambda: not only_model(router).pool.get("prefill-0").healthy)  # its polls fail
        response = await client.post(COMPLETIONS, json=completion())
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "aaaa"
        assert response.headers[PREFILL] == "local:prefill_unavailable"
        assert PREFILL_REPLICA not in response.headers


async def test_a_dead_prefill_replica_leaves_the_whole_request_to_decode(
    monkeypatch: pytest.MonkeyPatch, submitted: dict[str, list[GenerateRequest]]
) -> None:
    async with pd() as (router, client):
        kill_engine(router, "prefill-0", monkeypatch)  # still taken for healthy
        response = await client.post(COMPLETIONS, json=completion())
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "aaaa"
        # The headers say where the prompt ran, not where it was planned to (once not).
        assert response.headers[PREFILL] == "local:prefill_failed"
        assert PREFILL_REPLICA not in response.headers
        (decode,) = submitted["decode-0"]
        assert (decode.prompt_token_ids, decode.sampling_params.max_tokens) == (PROMPT, 4)
        assert decode.kv_transfer_params is None
        decisions = "splitserve_prefill_decisions_total"
        assert await metric(client, decisions, where="local", reason="prefill_failed") == 1


async def test_a_dead_decode_replica_fails_a_stream_after_the_prefills_token_with_an_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pd() as (router, client):
        kill_engine(router, "decode-0", monkeypatch)
        response = await client.post(COMPLETIONS, json=completion(stream=True))
        assert response.status_code == 200  # the prefill replica's first token went out
        token, error = sse_events(response)
        assert token["choices"][0]["text"] == "a"
        assert set(error) == {"error"} and "decode-0" in error["error"]["message"]


async def test_a_dead_decode_replica_is_a_503_with_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pd() as (router, client):
        kill_engine(router, "decode-0", monkeypatch)
        response = await client.post(COMPLETIONS, json=completion())
        # Not a 500 (once, since the prefill's first token counted though none was sent).
        message = openai_error(response, 503, "ServiceUnavailableError", None)
        assert "decode-0" in message
        assert response.headers["retry-after"] == "5"  # router.submit_timeout_s
