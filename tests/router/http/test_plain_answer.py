"""The router's own rendering writes each chunk it reads as one event (a chunk of several
tokens where it read behind its engine: router/pool/mailbox.py), and an engine that fails
mid-stream ends the stream with an error event after what was sent; the request's life
is released however it ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

from engines.protocol import GenerateChunk
from router.http.plain_answer import plain_answer
from router.http.responses import SSE_DONE, ResponseWriter
from router.lifecycle import Lifecycle, Opened, RequestLife
from router.observation.metrics import RouterMetrics
from router.observation.requests import RequestMetrics
from router.policies.prefill_policy import PrefillDecision
from router.settings import RouterConfig


def _chunks(*texts: str, finished: bool = True) -> list[GenerateChunk]:
    chunks = [GenerateChunk(token_ids=[i], text=text) for i, text in enumerate(texts)]
    if finished:
        chunks[-1].finish_reason = "length"
    return chunks


def _opened(life: RequestLife, chunks: list[GenerateChunk], fail: bool) -> Opened:
    async def stream() -> AsyncGenerator[GenerateChunk, None]:
        for chunk in chunks[1:]:
            yield chunk
        if fail:
            raise RuntimeError("engine died")

    engine = SimpleNamespace(name="engine-0", role="mixed", state=SimpleNamespace(in_flight=0))
    plan = SimpleNamespace(
        request=SimpleNamespace(prompt_token_ids=[1, 2]), priority="normal", cached_by_signal={}
    )
    dispatch: Any = SimpleNamespace(
        plan=plan,
        stream=stream(),
        engines=[engine],
        prefill_engine=engine,
        expected_cached_tokens=0,
        decision=PrefillDecision("local", "colocated"),
        response_headers=dict,
    )
    life._started(dispatch)
    return Opened(dispatch, chunks[0], 0.0)


def _writes(chunks: list[GenerateChunk], fail: bool = False) -> tuple[list[str], list[str]]:
    """What the stream wrote, and how its life was counted."""
    counted: list[str] = []
    metrics = RouterMetrics().for_model("m")
    dispatcher: Any = SimpleNamespace(policy_of=lambda choice, prefill: "round_robin")
    recorded = RequestMetrics(metrics, "single", dispatcher, None, None)
    config = RouterConfig()
    lifecycle = Lifecycle("m", config, dispatcher, None, None, recorded)  # type: ignore[arg-type]
    life = RequestLife("/v1/completions", "r", lambda life: counted.append(str(life.status)))
    life.lifecycle = lifecycle
    prepared: Any = SimpleNamespace(stream=True, include_usage=False, prompt_token_ids=[1, 2])
    writer = ResponseWriter(chat=False, model="m", response_id="r", return_token_ids=False)

    async def run() -> list[str]:
        opened = _opened(life, chunks, fail)
        response: Any = await plain_answer(life, opened, prepared, writer)
        try:
            return [item async for item in response.body_iterator]
        finally:
            life.status = response.status_code
            await life.release()

    writes = asyncio.run(run())
    return writes, counted


def test_each_chunk_is_one_event_and_the_stream_ends_with_done() -> None:
    writes, counted = _writes(_chunks("a", "bc", "d"))  # "bc": two tokens read as one chunk
    assert [
        ('"text":"' + text + '"') in write
        for write, text in zip(writes, ["a", "bc", "d"], strict=False)
    ] == [True] * 3
    assert writes[-1] == SSE_DONE and len(writes) == 4
    assert counted == ["200"]


def test_an_engine_that_fails_mid_stream_ends_it_with_an_error_event() -> None:
    writes, counted = _writes(_chunks("a", "b", finished=False), fail=True)
    assert '"text":"b"' in writes[1]
    assert "engine died" in writes[2] and writes[-1] == SSE_DONE
    assert counted == ["200"]  # the status was sent before the failure
