"""Render engine token deltas as OpenAI responses, using vLLM's own response models."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from json.encoder import encode_basestring

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

from engines.protocol import GenerateChunk
from router.http.errors import OpenAIError

SSE_DONE = "data: [DONE]\n\n"
# Stands for a delta's text in the template every plain delta event is cut from.
TEXT_MARK = "splitserve-delta-text-mark"


class EventStreamResponse(StreamingResponse):
    """SSE that always closes its event generator, however the response ends.

    Starlette cancels a stream whose client went away wherever it is waiting; when
    that is a ``send`` rather than the generator, the generator stays suspended at its
    ``yield`` until garbage collection. (The request's engines are released by its
    life, router/http/life_response.py, either way.)
    """

    def __init__(self, events: AsyncGenerator[str, None], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


@dataclass(slots=True)
class Transcript:
    """What one request generated so far; the source of the final response and usage."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0

    def add(self, chunk: GenerateChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text.append(chunk.text)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.stop_reason = chunk.stop_reason if chunk.stop_reason is not None else self.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)

    def usage(self) -> UsageInfo:
        prompt_tokens = len(self.prompt_token_ids)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(self.token_ids),
            total_tokens=prompt_tokens + len(self.token_ids),
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=self.num_cached_tokens),
        )


class ResponseWriter:
    """Formats one request's chunks; knows whether it is a chat or a plain completion."""

    def __init__(self, *, chat: bool, model: str, response_id: str, return_token_ids: bool) -> None:
        self._chat = chat
        self._model = model
        self._id = response_id
        self._created = int(time.time())
        self._return_token_ids = return_token_ids

    def first_event(self, transcript: Transcript) -> str | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if not self._chat:
            return None
        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(role="assistant", content="")
        )
        return self._sse(
            ChatCompletionStreamResponse(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[choice],
                prompt_token_ids=self._ids(transcript.prompt_token_ids),
            )
        )

    def delta_event(self, chunk: GenerateChunk, transcript: Transcript, first: bool) -> str:
        if self._plain_text(chunk, first):
            try:
                chunk.text.encode()  # what the model would refuse (a lone surrogate) takes its path
                prefix, suffix = self._text_template
                return f"{prefix}{encode_basestring(chunk.text)}{suffix}"
            except UnicodeEncodeError:
                pass
        return self._rendered_delta(chunk, transcript, first)

    def _plain_text(self, chunk: GenerateChunk, first: bool) -> bool:
        """A delta whose event differs from its neighbours' only in its text.

        Most events of a stream are these. vLLM's models validate and serialize each
        one (9-12 us a token, a quarter of the router's CPU per relayed token); the
        template is those models' own rendering of such a delta, cut at its text, so the
        bytes are the same (tests/router/http/test_responses.py compares them)."""
        return not (
            first
            or self._return_token_ids
            or chunk.finish_reason is not None
            or chunk.stop_reason is not None
        )

    @functools.cached_property
    def _text_template(self) -> tuple[str, str]:
        chunk = GenerateChunk(token_ids=[], text=TEXT_MARK)
        rendered = self._rendered_delta(chunk, Transcript(prompt_token_ids=[]), first=False)
        # The text follows the id and the model name, which a served name could repeat.
        prefix, _, suffix = rendered.rpartition(encode_basestring(TEXT_MARK))
        return prefix, suffix

    def _rendered_delta(self, chunk: GenerateChunk, transcript: Transcript, first: bool) -> str:
        token_ids = self._ids(chunk.token_ids)
        if self._chat:
            choice = ChatCompletionResponseStreamChoice(
                index=0,
                delta=DeltaMessage(content=chunk.text),
                finish_reason=chunk.finish_reason,
                stop_reason=chunk.stop_reason,
                token_ids=token_ids,
            )
            return self._sse(
                ChatCompletionStreamResponse(
                    id=self._id, created=self._created, model=self._model, choices=[choice]
                )
            )
        completion_choice = CompletionResponseStreamChoice(
            index=0,
            text=chunk.text,
            finish_reason=chunk.finish_reason,
            stop_reason=chunk.stop_reason,
            token_ids=token_ids,
            prompt_token_ids=self._ids(transcript.prompt_token_ids) if first else None,
        )
        return self._sse(
            CompletionStreamResponse(
                id=self._id, created=self._created, model=self._model, choices=[completion_choice]
            )
        )

    def usage_event(self, transcript: Transcript) -> str:
        response_cls = ChatCompletionStreamResponse if self._chat else CompletionStreamResponse
        return self._sse(
            response_cls(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[],
                usage=transcript.usage(),
            )
        )

    @staticmethod
    def error_event(error: OpenAIError) -> str:
        return f"data: {json.dumps(error.body())}\n\n"

    def final_response(self, transcript: Transcript) -> dict[str, object]:
        text = "".join(transcript.text)
        token_ids = self._ids(transcript.token_ids)
        response: ChatCompletionResponse | CompletionResponse
        if self._chat:
            response = ChatCompletionResponse(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[
                    ChatCompletionResponseChoice(
                        index=0,
                        message=ChatMessage(role="assistant", content=text),
                        finish_reason=transcript.finish_reason,
                        stop_reason=transcript.stop_reason,
                        token_ids=token_ids,
                    )
                ],
                usage=transcript.usage(),
                prompt_token_ids=self._ids(transcript.prompt_token_ids),
            )
        else:
            response = CompletionResponse(
                id=self._id,
                created=self._created,
                model=self._model,
                choices=[
                    CompletionResponseChoice(
                        index=0,
                        text=text,
                        finish_reason=transcript.finish_reason,
                        stop_reason=transcript.stop_reason,
                        token_ids=token_ids,
                        prompt_token_ids=self._ids(transcript.prompt_token_ids),
                    )
                ],
                usage=transcript.usage(),
            )
        return response.model_dump(exclude_none=True)

    def _ids(self, ids: list[int]) -> list[int] | None:
        return list(ids) if self._return_token_ids else None

    @staticmethod
    def _sse(model: object) -> str:
        return f"data: {model.model_dump_json(exclude_none=True)}\n\n"  # type: ignore[attr-defined]
