"""The relay writes what already waits in the router in one go, each token still an
event of its own, and never holds an event back for a token that has not arrived."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

from engines.protocol import GenerateChunk
from router.http.errors import OpenAIError
from router.http.relay import COALESCED_EVENTS_MAX, Relay
from router.http.responses import SSE_DONE, ResponseWriter


class _Observer:
    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _Dispatch:
    """A stream of ``chunks``; ``waiting[i]``: how many more wait in the router once the
    relay has read chunk i (what ``Dispatch.backlog`` reads off the engine's queue)."""

    def __init__(self, chunks: list[GenerateChunk], waiting: list[int], fail: bool = False):
        self._waiting = waiting
        self.read = 0
        self.released = False
        self.replicas: list[Any] = []
        self.decision = None

        async def stream() -> AsyncGenerator[GenerateChunk, None]:
            for chunk in chunks[1:]:
                self.read += 1
                yield chunk
            if fail:
                raise RuntimeError("engine died")

        self.stream = stream()

    def backlog(self) -> int:
        return self._waiting[self.read]


def _chunks(count: int) -> list[GenerateChunk]:
    texts = [GenerateChunk(token_ids=[i], text=f"t{i}") for i in range(count - 1)]
    return [*texts, GenerateChunk(token_ids=[count - 1], text="end", finish_reason="length")]


def _relay() -> Relay:
    def failure(error: Exception, names: str, sent: bool) -> OpenAIError:
        return OpenAIError(str(error), HTTPStatus.SERVICE_UNAVAILABLE)

    return Relay(_Observer(), SimpleNamespace(), failure)  # type: ignore[arg-type]


def _writes(dispatch: _Dispatch, first: GenerateChunk) -> list[str]:
    prepared = SimpleNamespace(stream=True, include_usage=False, prompt_token_ids=[1, 2])
    writer = ResponseWriter(chat=False, model="m", response_id="r", return_token_ids=False)

    async def run() -> list[str]:
        events = _relay().events(dispatch, (first, 0.0), prepared, writer, 0.0)  # type: ignore[arg-type]
        return [item async for item in events]

    return asyncio.run(run())


def _events(writes: list[str]) -> list[str]:
    return [event for write in writes for event in write.split("\n\n") if event]


def test_a_relay_that_keeps_up_writes_each_event_as_it_comes() -> None:
    chunks = _chunks(5)
    writes = _writes(_Dispatch(chunks, [0] * 5), chunks[0])
    assert len(writes) == 5 + 1  # and [DONE]
    assert writes[-1] == SSE_DONE


def test_what_waits_in_the_router_is_written_at_once() -> None:
    chunks = _chunks(6)
    # After the first two reads, three more wait: those four go out in one write.
    writes = _writes(_Dispatch(chunks, [1, 3, 2, 1, 0, 0]), chunks[0])
    events = _events(writes)
    assert len(events) == 6 + 1
    assert [write.count("data: ") for write in writes] == [5, 1, 1]
    assert '"text":"t0"' in events[0] and '"text":"end"' in events[5]


def test_a_long_backlog_is_written_in_bounded_writes() -> None:
    count = 2 * COALESCED_EVENTS_MAX + 1
    chunks = _chunks(count)
    writes = _writes(_Dispatch(chunks, [1] * (count - 1) + [0]), chunks[0])
    assert max(write.count("data: ") for write in writes) == COALESCED_EVENTS_MAX
    assert len(_events(writes)) == count + 1


def test_held_events_go_out_before_the_error_event() -> None:
    chunks = _chunks(4)[:3]  # no finish: the engine dies after the third
    writes = _writes(_Dispatch(chunks, [1, 1, 1], fail=True), chunks[0])
    events = _events(writes)
    assert ['"text":"t2"' in event for event in events[:3]] == [False, False, True]
    assert "engine died" in events[3] and writes[-1] == SSE_DONE
