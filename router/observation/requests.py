"""What the router records of each request as it runs: the engine it was sent to and
why, its time in the router's queue, its first token and the gaps after, how far the
prefix estimate was from what vLLM found, where its prompt was computed, and, once it
ends, its tokens and its place in the traffic record and drift."""

from __future__ import annotations

import time
from collections.abc import Callable

from engines.protocol import GenerateChunk
from router.dispatch import Dispatch, Dispatcher, Plan
from router.observation.metrics import ModelMetrics
from router.observation.traffic_drift import TrafficDrift
from router.observation.traffic_record import TrafficRecorder
from router.pd_flow import PREFILL_FALLBACK_REASONS
from router.policies.prefill_policy import PrefillDecision
from router.pool.pooled_engine import PooledEngine


class RequestObserver:
    def __init__(
        self,
        metrics: ModelMetrics,
        shape: str,
        dispatcher: Dispatcher,
        recorder: TrafficRecorder | None,
        drift: TrafficDrift | None,
    ) -> None:
        self._metrics = metrics
        self._shape = shape
        self._dispatcher = dispatcher
        self._recorder = recorder
        self._drift = drift
        # Observed once per relayed token: the labelled child is looked up once.
        self._itl = metrics.itl.labels(shape)

    def queue_timer(self, arrival: float) -> Callable[[], None]:
        """Called when an engine accepts the request: its time in the router's queue."""

        def accepted() -> None:
            self._metrics.queue.labels(self._shape).observe(time.perf_counter() - arrival)

        return accepted

    def choices(self, plan: Plan) -> None:
        for choice, prefill in ((plan.main, False), (plan.prefill, True)):
            if choice is not None:
                replica = choice.replica
                policy = self._dispatcher.policy_of(choice, prefill)
                self._metrics.replica_choices.labels(
                    replica.role, policy, replica.name, choice.reason
                ).inc()

    def track(self, replicas: list[PooledEngine], delta: int) -> None:
        """Requests in flight on each engine, ``delta`` more (a start) or fewer."""
        for replica in replicas:
            replica.in_flight += delta
            labels = (replica.name, replica.role)
            self._metrics.replica_in_flight.labels(*labels).set(replica.in_flight)
            if delta > 0:
                self._metrics.replica_requests.labels(*labels).inc()

    def token(
        self, arrival: float, last_token_at: float | None, now: float, decision: PrefillDecision
    ) -> None:
        """A streamed token: the first one's TTFT, or the gap since the last."""
        if last_token_at is None:
            self._metrics.ttft.labels(self._shape, decision.where).observe(now - arrival)
        else:
            self._itl.observe(now - last_token_at)

    def prefix_estimate(self, dispatch: Dispatch, chunk: GenerateChunk) -> None:
        """Set the router's prefix-cache estimate beside what vLLM found, per replica."""
        if dispatch.decision.reason in PREFILL_FALLBACK_REASONS:
            return  # another replica computed the prompt than the one estimated for
        name = dispatch.prefill_replica.name
        tokens = self._metrics.prefix_cache_tokens
        tokens.labels(name, "estimated").inc(dispatch.expected_cached_tokens)
        tokens.labels(name, "reported").inc(chunk.num_cached_tokens)
        for signal, estimate in dispatch.plan.cached_by_signal.items():
            tokens.labels(name, signal).inc(estimate)
            error = abs(estimate - chunk.num_cached_tokens)
            self._metrics.prefix_estimate_error.labels(signal).observe(error)

    def finished(
        self, dispatch: Dispatch, arrival: float, prompt_token_ids: list[int], generated: int
    ) -> None:
        """A finished request in the router's metrics, traffic record and drift."""
        self._metrics.e2e.labels(self._shape).observe(time.perf_counter() - arrival)
        self._metrics.tokens.labels("prompt").inc(len(prompt_token_ids))
        self._metrics.tokens.labels("generation").inc(generated)
        if self._recorder is not None:
            self._recorder.record(arrival, prompt_token_ids, generated, dispatch.plan.priority)
        if self._drift is not None:
            self._drift.observe(arrival, len(prompt_token_ids), generated)

    def prefill_decided(self, decision: PrefillDecision) -> None:
        """Where its prompt was computed, as it ran, once the request is over."""
        self._metrics.prefill_decisions.labels(decision.where, decision.reason).inc()
