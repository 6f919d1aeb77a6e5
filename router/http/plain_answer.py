"""The router's own rendering of an opened request (the plain path: no tools, logprobs,
``n`` > 1 or the rest that vLLM's serving layer renders): SSE events as its chunks come,
or one body at its end.

A relay behind its engine reads what waits as one chunk (router/pool/mailbox.py) and
writes it as one event, as vLLM's server does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from fastapi.responses import JSONResponse, Response

from router.http.requests import PreparedRequest
from router.http.responses import SSE_DONE, EventStreamResponse, ResponseWriter, Transcript
from router.lifecycle import Opened, RequestLife


async def plain_answer(
    life: RequestLife, opened: Opened, prepared: PreparedRequest, writer: ResponseWriter
) -> Response:
    """A stream of events as they come, or the whole answer once it has ended."""
    if prepared.stream:
        return EventStreamResponse(_events(life, opened, prepared, writer), opened.headers())
    return await _whole(life, opened, prepared, writer)


async def _whole(
    life: RequestLife, opened: Opened, prepared: PreparedRequest, writer: ResponseWriter
) -> Response:
    """A failure is the answer's status: nothing was sent yet."""
    transcript = Transcript(prompt_token_ids=prepared.prompt_token_ids)
    try:
        async for chunk in life.relay(opened, streamed=False):
            transcript.add(chunk)
    except Exception as error:
        raise life.failure_of(opened, error, sent=False) from error
    return JSONResponse(writer.final_response(transcript), headers=opened.headers())


async def _events(
    life: RequestLife, opened: Opened, prepared: PreparedRequest, writer: ResponseWriter
) -> AsyncGenerator[str, None]:
    transcript = Transcript(prompt_token_ids=prepared.prompt_token_ids)
    if opening := writer.first_event(transcript):
        yield opening
    try:
        async for chunk in life.relay(opened, streamed=True):
            is_first = not transcript.token_ids
            transcript.add(chunk)
            yield writer.delta_event(chunk, transcript, is_first)
        if prepared.include_usage:
            yield writer.usage_event(transcript)
    except Exception as error:  # the engine failed mid-stream: an error event after what was sent
        failure = life.failure_of(opened, error, sent=bool(transcript.token_ids))
        yield writer.error_event(failure)
    yield SSE_DONE
