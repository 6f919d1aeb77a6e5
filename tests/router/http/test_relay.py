"""The relay writes each chunk it reads as one event (a chunk of several tokens where
it read behind its engine: router/pool/mailbox.py), and an engine that fails
mid-stream ends the stream with an error event after what was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from engines.protocol import GenerateChunk
from router.http.errors import OpenAIError
from router.http.relay import Relay
from router.http.responses import SSE_DONE, ResponseWriter


class _Observer:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Dispatch:
    def __init__(self, chunks: list[GenerateChunk], fail: bool = False) -> None:
        self.released = False
        self.replicas: list[Any] = []
        self.decision = None

        async def stream() -> AsyncGenerator[GenerateChunk, None]:
            for chunk in chunks[1:]:
                yield chunk
            if fail:
                raise RuntimeError("engine died")

        self.stream = stream()


def _chunks(*texts: str, finished: bool = True) -> list[GenerateChunk]:
    chunks = [GenerateChunk(token_ids=[i], text=text) for i, text in enumerate(texts)]
    if finished:
        chunks[-1].finish_reason = "length"
    return chunks


def _writes(dispatch: _Dispatch, first: GenerateChunk) -> list[str]:
    prepared = SimpleNamespace(stream=True, include_usage=False, prompt_token_ids=[1, 2])
    writer = ResponseWriter(chat=False, model="m", response_id="r", return_token_ids=False)

    def failure(error: Exception, names: str, sent: bool) -> OpenAIError:
        return OpenAIError(str(error), HTTPStatus.SERVICE_UNAVAILABLE)

    relay = Relay(_Observer(), SimpleNamespace(), failure)  # type: ignore[arg-type]

    async def run() -> list[str]:
        events = relay.events(dispatch, (first, 0.0), prepared, writer, 0.0)  # type: ignore[arg-type]
        return [item async for item in events]

    return asyncio.run(run())


def test_each_chunk_is_one_event_and_the_stream_ends_with_done() -> None:
    chunks = _chunks("a", "bc", "d")  # "bc": two tokens read as one chunk
    dispatch = _Dispatch(chunks)
    writes = _writes(dispatch, chunks[0])
    assert [
        ('"text":"' + text + '"') in write
        for write, text in zip(writes, ["a", "bc", "d"], strict=False)
    ] == [True] * 3
    assert writes[-1] == SSE_DONE and len(writes) == 4
    assert dispatch.released


def test_an_engine_that_fails_mid_stream_ends_it_with_an_error_event() -> None:
    chunks = _chunks("a", "b", finished=False)
    dispatch = _Dispatch(chunks, fail=True)
    writes = _writes(dispatch, chunks[0])
    assert '"text":"b"' in writes[1]
    assert "engine died" in writes[2] and writes[-1] == SSE_DONE
    assert dispatch.released
