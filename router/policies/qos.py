"""QoS: each request's priority, and whether to admit it.

Admission runs after the dispatcher has planned where a request would go, because the
TTFT estimate depends on the engine that would compute its prompt. Refusals are cheap
on purpose: no engine is touched, so an overloaded cluster still answers them in
milliseconds. The policy decides (a ``Refusal``, or None to admit); HTTP says it
(router/http/errors.py ``rejection``: 429 for a full queue, 503 for a TTFT beyond the
limit, each with Retry-After).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from router.policies.fair_share import Standing
from router.settings import Priority, QoSConfig

# vLLM's priority scheduling runs lower numbers first.
ENGINE_PRIORITY: dict[Priority, int] = {"high": 0, "normal": 1, "low": 2}


# queue_full: a priority's router-wide cap; ttft_slo: its early-rejection limit;
# key_queue_full: an API key's own cap (router/http/auth.py).
RefusalReason = Literal["queue_full", "ttft_slo", "key_queue_full"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("queue_full", "ttft_slo", "key_queue_full")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Admission's decision not to take a request: why (the metrics' reason), what to
    tell the client, and when it may retry."""

    reason: RefusalReason
    message: str
    retry_after_s: int


class AdmissionControl:
    """Refuses what the cluster should not take: beyond a priority's queue cap (429), or
    a priority whose estimated TTFT exceeds its early-rejection limit (503). An API
    key under its fair share of its priority's waiting requests keeps its place past
    either (router/policies/fair_share.py): the keys over theirs are refused first."""

    def __init__(self, config: QoSConfig) -> None:
        self._config = config

    def check(
        self,
        priority: Priority,
        queued: Callable[[], int],
        ttft_estimate_s: Callable[[], float | None],
        standing: Standing | None = None,
    ) -> Refusal | None:
        """A Refusal, or None to admit. ``queued``: requests router-wide that
        are still waiting for their first token; ``ttft_estimate_s``: the TTFT estimate
        (None until measured). Each is asked only when a rule needs it: both scan every
        engine on every request, and most priorities (every one, with QoS off) have no
        rule that weighs them. ``standing``: the request's key among its priority's
        (None: no shares are kept)."""
        config = self._config
        if not config.enabled:
            return None
        cap = config.queue_caps[priority]
        if (waiting := queued()) >= cap and not (standing and standing.under_share(cap)):
            return Refusal(
                "queue_full",
                f"too many requests waiting ({waiting}, the cap for {priority} priority is"
                f" {cap}); retry after {config.retry_after_s} s",
                config.retry_after_s,
            )
        limit = config.early_rejection_s.get(priority)
        if limit is None or (standing and standing.under_share()):
            return None  # an estimate of the whole queue: a key under its share goes sooner
        estimate = ttft_estimate_s()
        if estimate is not None and estimate > limit:
            return Refusal(
                "ttft_slo",
                f"the server is overloaded: estimated time to first token"
                f" {estimate:.2f} s exceeds the {limit:g} s allowed for {priority}"
                f" priority; retry after {config.retry_after_s} s",
                config.retry_after_s,
            )
        return None
