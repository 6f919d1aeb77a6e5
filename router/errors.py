"""Errors in the OpenAI error format, raised anywhere in the router and rendered once."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
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
                "type": _ERROR_TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": int(self.status),
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=int(self.status), headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, param)
