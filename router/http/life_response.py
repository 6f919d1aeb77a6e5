"""The HTTP response of one request's life: its answer made and sent in one
``try``/``finally`` that releases the life (router/lifecycle.py), however it ends: a
refusal, a whole body, a stream the client left, a task cancelled mid-way."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.http.errors import ANTHROPIC_ROUTES, OpenAIError
from router.lifecycle import RequestLife

logger = logging.getLogger("splitserve.router")


class LifeResponse(Response):
    """Makes its answer when sent (``answer``: a refusal is raised as an OpenAIError) and
    sends it inside the life; the status the life is counted with is the answer's."""

    def __init__(self, life: RequestLife, answer: Callable[[], Awaitable[Response]]) -> None:
        # No body of its own: the answer's is sent. FastAPI sets ``background``.
        self.status_code = HTTPStatus.OK
        self.background: BackgroundTask | None = None
        self._life = life
        self._answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        life = self._life
        anthropic = life.route in ANTHROPIC_ROUTES
        try:
            try:
                response = await self._answer()
            except OpenAIError as error:
                response = error.response(life.headers, anthropic)
            except Exception as error:  # a bug of ours: still an answer in the API's format
                logger.exception("the router failed a request on %s", life.route)
                response = OpenAIError(
                    f"the router failed: {type(error).__name__}: {error}",
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                ).response(anthropic=anthropic)
            life.status = response.status_code
            await response(scope, receive, send)
        finally:
            await life.release()
        if self.background is not None:
            await self.background()
