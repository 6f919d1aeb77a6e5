"""QoS: each request's priority, and whether to admit it.

Admission runs after the dispatcher has planned where a request would go, because the
TTFT estimate depends on the replica that would compute its prompt. Refusals are cheap
on purpose: no engine is touched, so an overloaded cluster still answers them in
milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from router.http.errors import OpenAIError
from router.settings import PRIORITIES, Priority, QoSConfig
from splitserve.metric_catalogue import PRIORITY_HEADER

# vLLM's priority scheduling runs lower numbers first.
ENGINE_PRIORITY: dict[Priority, int] = {"high": 0, "normal": 1, "low": 2}


def take_priority(body: Any, headers: Any, default: Priority) -> Priority:
    """The request's priority from its ``priority`` field (removed from the body, since
    vLLM's own ``priority`` is an integer) or else the ``x-priority`` header."""
    value = body.pop("priority", None) if isinstance(body, dict) else None
    where = "priority"
    if value is None:
        value, where = headers.get(PRIORITY_HEADER), f"{PRIORITY_HEADER} header"
    if value is None:
        return default
    name = str(value).strip().lower()
    if name not in PRIORITIES:
        raise OpenAIError(
            f"{where} must be one of {', '.join(PRIORITIES)}; got {value!r}",
            HTTPStatus.BAD_REQUEST,
            "priority",
        )
    return name


class Rejection(OpenAIError):
    """A refused request (503 or 429, with Retry-After) and why, for the metrics."""

    def __init__(self, message: str, status: HTTPStatus, reason: str, retry_after_s: int) -> None:
        super().__init__(message, status, retry_after_s=retry_after_s)
        self.reason = reason


class AdmissionControl:
    """Refuses what the cluster should not take: beyond a priority's queue cap (429), or
    a priority whose estimated TTFT exceeds its early-rejection limit (503)."""

    def __init__(self, config: QoSConfig) -> None:
        self._config = config

    def check(
        self,
        priority: Priority,
        queued: Callable[[], int],
        ttft_estimate_s: Callable[[], float | None],
    ) -> None:
        """Raise a Rejection, or return to admit. ``queued``: requests router-wide that
        are still waiting for their first token; ``ttft_estimate_s``: the TTFT estimate
        (None until measured). Each is asked only when a rule needs it: both scan every
        replica on every request, and most priorities (every one, with QoS off) have no
        rule that weighs them."""
        config = self._config
        if not config.enabled:
            return
        cap = config.queue_caps[priority]
        if (waiting := queued()) >= cap:
            raise Rejection(
                f"too many requests waiting ({waiting}, the cap for {priority} priority is"
                f" {cap}); retry after {config.retry_after_s} s",
                HTTPStatus.TOO_MANY_REQUESTS,
                "queue_full",
                config.retry_after_s,
            )
        limit = config.early_rejection_s.get(priority)
        if limit is None:
            return
        estimate = ttft_estimate_s()
        if estimate is not None and estimate > limit:
            raise Rejection(
                f"the server is overloaded: estimated time to first token"
                f" {estimate:.2f} s exceeds the {limit:g} s allowed for {priority}"
                f" priority; retry after {config.retry_after_s} s",
                HTTPStatus.SERVICE_UNAVAILABLE,
                "ttft_slo",
                config.retry_after_s,
            )
