"""A started request's way back to the client: its chunks relayed as SSE events or
collected into one body (the router's own path), or handed to vLLM's serving layer,
each timed and counted by the request's observer, and its engines released however it
ends."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi.responses import JSONResponse, Response

from engines.protocol import GenerateChunk
from router.dispatch import Dispatch
from router.http.errors import OpenAIError
from router.http.requests import PreparedRequest
from router.http.responses import SSE_DONE, ResponseWriter, Transcript
from router.http.vllm_frontend import FrontendCall
from router.observation.metrics import ModelMetrics
from router.observation.requests import RequestObserver
from router.settings import Priority

logger = logging.getLogger("splitserve.router")
# What an engine's failure is answered with: (error, engines' names, sent anything yet).
FailureStatus = Callable[[Exception, str, bool], OpenAIError]


async def _after(
    first: tuple[GenerateChunk, float], stream: AsyncIterator[GenerateChunk]
) -> AsyncIterator[tuple[GenerateChunk, float]]:
    """The chunk already read, then the rest of the stream, each with when it came."""
    yield first
    async for chunk in stream:
        yield chunk, time.perf_counter()


class Relay:
    def __init__(
        self, observer: RequestObserver, metrics: ModelMetrics, failure: FailureStatus
    ) -> None:
        self._observer = observer
        self._metrics = metrics
        self._failure = failure

    async def release(self, dispatch: Dispatch) -> None:
        """Once per dispatch, however the request ends: close its stream (which aborts
        it in the engine if it still runs) and count it."""
        if dispatch.released:
            return
        dispatch.released = True
        self._observer.track(dispatch.replicas, -1)
        await dispatch.stream.aclose()
        self._observer.prefill_decided(dispatch.decision)

    async def events(
        self,
        dispatch: Dispatch,
        first: tuple[GenerateChunk, float],
        prepared: PreparedRequest,
        writer: ResponseWriter,
        arrival: float,
    ) -> AsyncGenerator[Any, None]:
        """SSE strings when streaming; for non-stream requests, the final Transcript.
        ``first``: the stream's first chunk, already read (ServedModel._open), and when.
        A relay behind its engine reads what waits as one chunk (router/pool/mailbox.py)
        and writes it as one event."""
        transcript = Transcript(prompt_token_ids=prepared.prompt_token_ids)
        last_token_at: float | None = None
        # Closing the stream early (client gone) aborts the request in the engine.
        stream = dispatch.stream
        try:
            if prepared.stream and (opening := writer.first_event(transcript)):
                yield opening
            async for chunk, now in _after(first, stream):
                if chunk.token_ids and prepared.stream:
                    self._observer.token(arrival, last_token_at, now, dispatch.decision)
                    last_token_at = now
                is_first = not transcript.token_ids
                if is_first:
                    self._observer.prefix_estimate(dispatch, chunk)
                transcript.add(chunk)
                if prepared.stream:
                    yield writer.delta_event(chunk, transcript, is_first)
            self._observer.finished(
                dispatch, arrival, transcript.prompt_token_ids, len(transcript.token_ids)
            )
            if not prepared.stream:
                yield transcript
                return
            if prepared.include_usage:
                yield writer.usage_event(transcript)
            yield SSE_DONE
        except Exception as error:  # the engine failed mid-request
            names = "+".join(replica.name for replica in dispatch.replicas)
            logger.exception("a request failed on %s", names)
            # A non-streamed response has sent nothing yet, whatever the engines made.
            sent = prepared.stream and bool(transcript.token_ids)
            failure = self._failure(error, names, sent)
            if not prepared.stream:
                raise failure from error
            yield writer.error_event(failure)
            yield SSE_DONE
        finally:
            await self.release(dispatch)

    async def collect(
        self,
        events: AsyncIterator[Transcript | str],
        writer: ResponseWriter,
        route: str,
        headers: dict[str, str],
        priority: Priority,
    ) -> Response:
        transcript: Transcript | None = None
        try:
            async for item in events:
                if isinstance(item, Transcript):
                    transcript = item
        except OpenAIError as error:
            self._metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response(headers)
        assert transcript is not None
        self._metrics.requests.labels(route, "200", priority).inc()
        return JSONResponse(writer.final_response(transcript), headers=headers)

    async def chunks(
        self,
        dispatch: Dispatch,
        first: tuple[GenerateChunk, float],
        call: FrontendCall,
        streamed: bool,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """For vLLM's serving layer: the dispatch's chunks, timed and counted as the
        router's own path counts them."""
        last_token_at: float | None = None
        generated = 0
        try:
            async for chunk, now in _after(first, dispatch.stream):
                if chunk.token_ids and streamed:
                    self._observer.token(call.arrival, last_token_at, now, dispatch.decision)
                    last_token_at = now
                if not generated and chunk.token_ids:
                    self._observer.prefix_estimate(dispatch, chunk)
                generated += len(chunk.token_ids)
                yield chunk
            self._observer.finished(
                dispatch, call.arrival, dispatch.plan.request.prompt_token_ids, generated
            )
        except Exception as error:
            names = "+".join(replica.name for replica in dispatch.replicas)
            logger.exception("a request failed on %s", names)
            if not streamed:  # nothing was sent: the response is this status
                call.error = self._failure(error, names, False)
            raise
        finally:
            await self.release(dispatch)
