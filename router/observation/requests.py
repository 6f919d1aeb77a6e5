"""What the router records of each request as it lives (router/lifecycle.py calls it):
the engine it was sent to and why, its time in the router's queue, its first token and
the gaps after, how far the prefix estimate was from what vLLM found, where its prompt
was computed, and, once it ends, its tokens and its place in the traffic record and
drift. It only records: the routing state a request changes (its engines' in-flight
counts, prefill tickets) lives with the engines (router/pool/engine_state.py)."""

from __future__ import annotations

from collections.abc import Sequence

from engines.protocol import GenerateChunk
from router.dispatch import Dispatch, Dispatcher, Plan
from router.observation.metrics import ModelMetrics
from router.observation.traffic_drift import TrafficDrift
from router.observation.traffic_record import TrafficRecorder
from router.pd_flow import PREFILL_FALLBACK_REASONS
from router.policies.fair_share import Flow
from router.policies.prefill_policy import PrefillDecision
from router.pool.pooled_engine import PooledEngine


class RequestMetrics:
    def __init__(
        self,
        metrics: ModelMetrics,
        shape: str,
        dispatcher: Dispatcher,
        recorder: TrafficRecorder | None,
        drift: TrafficDrift | None,
    ) -> None:
        self.model = metrics
        self._shape = shape
        self._dispatcher = dispatcher
        self._recorder = recorder
        self._drift = drift
        # Observed once per relayed token: the labelled child is looked up once.
        self._itl = metrics.itl.labels(shape)

    def queued(self, seconds: float) -> None:
        """Its time in the router's queue, until an engine accepted it."""
        self.model.queue.labels(self._shape).observe(seconds)

    def choices(self, plan: Plan) -> None:
        for choice, prefill in ((plan.main, False), (plan.prefill, True)):
            if choice is not None:
                engine = choice.engine
                policy = self._dispatcher.policy_of(choice, prefill)
                self.model.replica_choices.labels(
                    engine.role, policy, engine.name, choice.reason
                ).inc()

    def in_flight(self, engines: Sequence[PooledEngine], started: bool) -> None:
        """Each engine's in-flight count as its state now has it; ``started``: one more
        request on each (counted)."""
        for engine in engines:
            labels = (engine.name, engine.role)
            self.model.replica_in_flight.labels(*labels).set(engine.state.in_flight)
            if started:
                self.model.replica_requests.labels(*labels).inc()

    def token(
        self,
        arrival: float,
        last_token_at: float | None,
        now: float,
        decision: PrefillDecision,
        flow: Flow,
    ) -> None:
        """A streamed token: the first one's TTFT (also by its key), or the gap since the
        last."""
        if last_token_at is None:
            self.model.ttft.labels(self._shape, decision.where).observe(now - arrival)
            self.model.key_ttft.labels(flow.name).observe(now - arrival)
        else:
            self._itl.observe(now - last_token_at)

    def key_waiting(self, key: str, priority: str, change: int) -> None:
        """One more (or fewer) of the key's admitted requests waiting for a first token."""
        self.model.key_waiting.labels(key, priority).inc(change)

    def prefix_estimate(self, dispatch: Dispatch, chunk: GenerateChunk) -> None:
        """Set the router's prefix-cache estimate beside what vLLM found, per engine."""
        if dispatch.decision.reason in PREFILL_FALLBACK_REASONS:
            return  # another engine computed the prompt than the one estimated for
        name = dispatch.prefill_engine.name
        tokens = self.model.prefix_cache_tokens
        tokens.labels(name, "estimated").inc(dispatch.expected_cached_tokens)
        tokens.labels(name, "reported").inc(chunk.num_cached_tokens)
        for signal, estimate in dispatch.plan.cached_by_signal.items():
            tokens.labels(name, signal).inc(estimate)
            error = abs(estimate - chunk.num_cached_tokens)
            self.model.prefix_estimate_error.labels(signal).observe(error)

    def finished(
        self,
        dispatch: Dispatch,
        arrival: float,
        now: float,
        prompt_token_ids: list[int],
        generated: int,
    ) -> None:
        """A finished request in the router's metrics, traffic record and drift."""
        self.model.e2e.labels(self._shape).observe(now - arrival)
        self.model.tokens.labels("prompt").inc(len(prompt_token_ids))
        self.model.tokens.labels("generation").inc(generated)
        if self._recorder is not None:
            self._recorder.record(arrival, prompt_token_ids, generated, dispatch.plan.priority)
        if self._drift is not None:
            self._drift.observe(arrival, len(prompt_token_ids), generated)

    def prefill_decided(self, decision: PrefillDecision) -> None:
        """Where its prompt was computed, as it ran, once the request is over."""
        self.model.prefill_decisions.labels(decision.where, decision.reason).inc()
