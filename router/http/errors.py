"""Errors in the OpenAI error format, raised anywhere in the router and rendered once."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from router.policies.qos import Refusal, RefusalReason

# Routes whose clients read errors in Anthropic's format.
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.GATEWAY_TIMEOUT: "TimeoutError",
}


class OpenAIError(Exception):
    """A request the router answers with an error body instead of a completion."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        # Client text quoted in a message may hold lone surrogates ("\udcff" is valid
        # JSON), which UTF-8 cannot encode: escape them, or rendering fails with a 500.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": int(self.status),
            }
        }

    @property
    def error_type(self) -> str:
        """OpenAI's name for the status, which both formats carry."""
        return _ERROR_TYPES.get(self.status, "APIError")

    def anthropic_body(self) -> dict[str, object]:
        """The same error as Anthropic's Messages API spells one (vLLM's
        ``translate_error_response``: OpenAI's error type, the message)."""
        return {"type": "error", "error": {"type": self.error_type, "message": self.message}}

    def response(
        self, headers: dict[str, str] | None = None, anthropic: bool = False
    ) -> JSONResponse:
        """``anthropic``: in the Messages API's format (its routes, ANTHROPIC_ROUTES)."""
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=int(self.status), headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, param)


async def routing_error_response(request: Request, error: Exception) -> JSONResponse:
    """What FastAPI refuses before any route runs (a path this router does not serve
    404, a method a route does not take 405), in the OpenAI format, as vLLM's server
    answers them; a 405 keeps its ``Allow`` header."""
    assert isinstance(error, HTTPException)
    status = HTTPStatus(error.status_code)
    target = f"{request.method} {request.url.path}"
    if status == HTTPStatus.NOT_FOUND:
        message = f"{target}: no such route on this server"
    elif status == HTTPStatus.METHOD_NOT_ALLOWED:
        message = f"{target}: the route does not take this method"
    else:
        message = f"{target}: {error.detail}"
    return OpenAIError(message, status).response(dict(error.headers or {}))


# How each admission refusal is said (router/policies/qos.py decides it): a full queue
# is the client's rate (429), a TTFT beyond the limit the server's load (503).
REFUSAL_STATUS: dict[RefusalReason, HTTPStatus] = {
    "queue_full": HTTPStatus.TOO_MANY_REQUESTS,
    "key_queue_full": HTTPStatus.TOO_MANY_REQUESTS,
    "ttft_slo": HTTPStatus.SERVICE_UNAVAILABLE,
}


class Rejection(OpenAIError):
    """A refused request as answered (429 or 503, with Retry-After) and why."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(
            refusal.message, REFUSAL_STATUS[refusal.reason], retry_after_s=refusal.retry_after_s
        )
        self.reason = refusal.reason
