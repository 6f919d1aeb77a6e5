"""One request's life in the router: admit, plan, open, relay, release.

A ``RequestLife`` takes one request from the moment the ingress reads it to the last
byte of its answer, one method a step:

1. ``enter``: its model is known and its API key took it, at a priority, with a place
   in the key's own queue (or refused, past the key's cap);
2. ``admit_early``: QoS refuses it before its body is parsed where its priority's queue
   alone breaks a limit and its key is not under its fair share;
3. ``plan``: the dispatcher plans its engines and where its prompt is computed, QoS
   refuses it by the plan's TTFT estimate, and an admitted request takes its key's
   turn within its priority (router/policies/fair_share.py);
4. ``open``: the plan starts and its first chunk is read, so that a failure before it
   is a status (an unavailable DP engine is replaced once); from the start it counts as
   in flight on its engines (their ``EngineState``), and once the first chunk is there
   where it runs is final, headers included, and its turn and key's place are over;
5. ``relay``: its chunks as they come, each streamed token timed, the prefix estimate
   set beside what the engine found, its end recorded;
6. ``release``: once, however it ended: its engine streams closed (which aborts what
   still runs and frees a hand-over's KV nobody loaded), its engines' in-flight counts
   undone, where its prompt ran counted, its key's queue slot and turn given back, and
   the request counted with its status (and, by key, as admitted or refused). Nothing
   else counts a request.

The HTTP answer (router/http/life_response.py) holds the whole life in one
``try``/``finally``. ``Lifecycle`` is what one served model's requests live through;
its clock (``RouterClock``) is the only time the steps read, so that the offline
simulation can run the same steps on a virtual one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from engines.contract import EngineFailed, EngineUnavailable
from engines.protocol import GenerateChunk, GenerateRequest
from router.dispatch import Dispatch, Dispatcher, Plan
from router.http.auth import EVERYONE, QueueSlot
from router.http.errors import OpenAIError, Rejection
from router.observation.requests import RequestMetrics
from router.policies.fair_share import FairShares, Flow, Standing, Turn
from router.policies.qos import ENGINE_PRIORITY, AdmissionControl, Refusal
from router.settings import Priority, RouterConfig

logger = logging.getLogger("splitserve.router")
# The status a request is counted with when it ended before it had an answer (its
# client went away, its task was cancelled), as nginx logs it.
CLIENT_CLOSED = 499
# The ``model`` label of a request refused before its body named a served model.
NO_MODEL = ""


class RouterClock(Protocol):
    """The time a request's life reads: ``now`` measures (monotonic seconds), ``deadline``
    is when a request started now is given up (in the event loop's time, which
    ``PooledEngine`` arms its timer with), or None where nothing is given up."""

    def now(self) -> float: ...

    def deadline(self, after_s: float) -> float | None: ...


class ReadinessView(Protocol):
    """What a request's life asks of its model's readiness (router/http/readiness.py)."""

    @property
    def is_ready(self) -> bool: ...

    async def wait(self, timeout_s: float) -> bool: ...

    def starting_error(self, retry_after_s: float) -> OpenAIError: ...


class WallClock:
    """The router's clock: ``time.perf_counter``, and the running event loop's time."""

    def now(self) -> float:
        return time.perf_counter()

    def deadline(self, after_s: float) -> float | None:
        return asyncio.get_running_loop().time() + after_s


# Counts one request once it ends (its model, route, status, priority, key's outcome).
RequestCount = Callable[["RequestLife"], None]
# The flow of requests without an API key: one, as fair shares count them.
KEYLESS = EVERYONE.flow


@dataclass(slots=True)
class Opened:
    """One engine request whose first chunk has come, and its relay's own timing."""

    dispatch: Dispatch
    first: GenerateChunk
    first_at: float
    last_token_at: float | None = None
    generated: int = 0

    def headers(self) -> dict[str, str]:
        """Where it runs: final, since a remote prefill falls back before its first token."""
        return self.dispatch.response_headers()


class Lifecycle:
    """What one served model's requests live through: its admission control and its
    keys' fair shares, dispatcher, readiness and metrics, and the clock they all read.
    Without ``fair_shares``, no turns are given (the offline simulation's one flow)."""

    def __init__(
        self,
        model: str,
        router: RouterConfig,
        dispatcher: Dispatcher,
        admission: AdmissionControl,
        readiness: ReadinessView,
        metrics: RequestMetrics,
        clock: RouterClock | None = None,
        fair_shares: FairShares | None = None,
    ) -> None:
        self.model = model
        self.router = router
        self.dispatcher = dispatcher
        self.admission = admission
        self.readiness = readiness
        self.metrics = metrics
        self.clock = clock or WallClock()
        self.fair_shares = fair_shares

    def enter(
        self,
        life: RequestLife,
        priority: Priority,
        slot: QueueSlot | Refusal | None,
        flow: Flow = KEYLESS,
    ) -> None:
        """``life`` is this model's request now, at ``priority``, of ``flow``, holding
        ``slot`` in its API key's queue until its first token (None: no key's queue
        holds it; a Refusal: the key's cap refused it, raised here)."""
        life.model, life.priority, life.granted = self.model, priority, priority
        life.lifecycle, life.flow = self, flow
        if isinstance(slot, Refusal):
            self.refuse(life, slot)
        else:
            life.slot = slot

    def refuse(self, life: RequestLife, refusal: Refusal | None) -> None:
        """Every refusal of a request, counted (by reason and priority, and by key at its
        release) and raised; None: admitted."""
        if refusal is not None:
            life.outcome = "refused"
            self.metrics.model.rejections.labels(refusal.reason, life.priority).inc()
            raise Rejection(refusal)

    def standing(self, life: RequestLife, priority: Priority) -> Standing | None:
        shares = self.fair_shares
        return None if shares is None else shares.standing(life.flow, priority)


class RequestLife:
    """One request from the ingress to its last byte (the steps: the module's docstring)."""

    def __init__(
        self, route: str, request_id: str, count: RequestCount, clock: RouterClock | None = None
    ) -> None:
        self.route = route
        self.request_id = request_id
        self.arrival = (clock or WallClock()).now()
        self.model = NO_MODEL
        # The priority it is counted at, and the one its model serves it at once known.
        self.priority = "none"
        self.granted: Priority | None = None
        # What the answer's status was; None until it has one.
        self.status: int | None = None
        # Set once the request's first token exists: where it ran (x-splitserve-*).
        self.headers: dict[str, str] = {}
        # A refusal or failure before any token, which the request is answered with: vLLM's
        # serving layer turns what ``generate`` raises into bodies of its own.
        self.error: OpenAIError | None = None
        self.lifecycle: Lifecycle | None = None
        self.slot: QueueSlot | None = None
        self.flow = KEYLESS
        self.turn: Turn | None = None  # from admission to its first token (fair shares)
        # By key, once its model's admission has decided: "admitted" or "refused".
        self.outcome: str | None = None
        self._count = count
        self._running: list[Dispatch] = []  # started, streams not yet closed
        self._opened: list[Dispatch] = []  # whose first chunk came: counted at release
        self._released = False

    # ---- admit and plan -----------------------------------------------------------------

    @property
    def _model(self) -> Lifecycle:
        assert self.lifecycle is not None, "the request entered no model's lifecycle"
        return self.lifecycle

    @property
    def _priority(self) -> Priority:
        assert self.granted is not None, "the request entered no model's lifecycle"
        return self.granted

    def admit_early(self) -> None:
        """Before the costly part (validation, tokenization): a priority whose queue
        alone already breaks its limit is refused here, in microseconds, so that a
        burst's refusals do not wait behind its admitted requests' parsing."""
        model = self._model
        if not model.readiness.is_ready:
            return  # nothing measured yet; the request waits for readiness
        priority = self._priority
        dispatcher = model.dispatcher
        refusal = model.admission.check(
            priority,
            dispatcher.queued_requests,
            lambda: dispatcher.earliest_ttft_s(priority),
            model.standing(self, priority),
        )
        model.refuse(self, refusal)

    def plan(self, request: GenerateRequest) -> Plan:
        """Where ``request`` runs (at the life's priority and its key's turn, with its
        deadline), admitted."""
        model = self._model
        priority = self._priority
        request.priority = ENGINE_PRIORITY[priority]
        request.deadline = model.clock.deadline(model.router.request_timeout_s)
        plan = model.dispatcher.plan(request, priority)
        estimate = plan.ttft_estimate_s()
        if estimate is not None:
            model.metrics.model.ttft_estimate.labels(plan.prefill_engine.name).set(estimate)
        refusal = model.admission.check(
            priority,
            model.dispatcher.queued_requests,
            lambda: estimate,
            model.standing(self, priority),
        )
        model.refuse(self, refusal)
        self.outcome = "admitted"
        if model.fair_shares is not None and self.turn is None:
            self.turn = model.fair_shares.join(self.flow, priority)
            request.turn = self.turn.number
            model.metrics.key_waiting(self.flow.name, priority, +1)
        return plan

    async def wait_ready(self) -> None:
        """Until every engine is up and calibrated, or ``router.ready_wait_s``: 503 then."""
        model = self._model
        if not await model.readiness.wait(model.router.ready_wait_s):
            raise model.readiness.starting_error(model.router.ready_wait_s)

    # ---- open and relay -----------------------------------------------------------------

    async def open(self, plan: Plan) -> Opened:
        """Start ``plan`` and read its first chunk. A DP request whose engine was
        unavailable is planned once more on another healthy engine (nothing was sent);
        anything else raises, for ``failure`` to turn into a status."""
        model = self._model
        tried: list[str] = []
        while True:
            tried.append(plan.prefill_engine.name)
            dispatch = model.dispatcher.start(plan, on_accepted=self._accepted)
            self._started(dispatch)
            try:
                chunk = await anext(dispatch.stream, None)
                if chunk is None:
                    raise EngineFailed("the engine ended the request without output")
            except BaseException as error:
                await self._let_go(dispatch)
                elsewhere = None
                if isinstance(error, EngineUnavailable) and len(tried) == 1:
                    elsewhere = model.dispatcher.replan_elsewhere(plan)
                if elsewhere is None:
                    if isinstance(error, Exception) and not isinstance(error, OpenAIError):
                        raise self.failure(error, " then ".join(tried), sent=False) from error
                    raise
                logger.warning(
                    "%s unavailable (%s); retrying on %s",
                    plan.main.engine.name,
                    error,
                    elsewhere.main.engine.name,
                )
                plan = elsewhere
                continue
            self._opened.append(dispatch)
            if self.slot is not None:
                self.slot.release()  # it has its first token: no longer queued for its key
            self._turn_over(started=True)
            model.metrics.choices(dispatch.plan)
            return Opened(dispatch, chunk, model.clock.now())

    async def relay(self, opened: Opened, streamed: bool) -> AsyncIterator[GenerateChunk]:
        """The request's chunks, its first one first; each token of a stream is timed (a
        whole answer has no token times), and its end is recorded."""
        model = self._model
        dispatch, metrics, clock = opened.dispatch, model.metrics, model.clock
        chunk, now = opened.first, opened.first_at
        while True:
            if chunk.token_ids:
                if streamed:
                    metrics.token(
                        self.arrival, opened.last_token_at, now, dispatch.decision, self.flow
                    )
                    opened.last_token_at = now
                if not opened.generated:
                    metrics.prefix_estimate(dispatch, chunk)
                opened.generated += len(chunk.token_ids)
            yield chunk
            following = await anext(dispatch.stream, None)
            if following is None:
                break
            chunk, now = following, clock.now()
        prompt = dispatch.plan.request.prompt_token_ids
        metrics.finished(dispatch, self.arrival, clock.now(), prompt, opened.generated)

    def failure(self, error: Exception, engines: str, sent: bool) -> OpenAIError:
        """What an engine's failure is answered with: 503 with Retry-After where an
        engine was unavailable before the client got any token, 504 past the request
        timeout, else 500. ``engines``: their names, for the message."""
        if isinstance(error, OpenAIError):
            return error
        router = self._model.router
        if isinstance(error, TimeoutError):
            logger.warning("a request timed out on %s", engines)
            return OpenAIError(
                f"the request did not finish within router.request_timeout_s"
                f" ({router.request_timeout_s:g} s) on {engines}; it was aborted",
                HTTPStatus.GATEWAY_TIMEOUT,
            )
        if isinstance(error, EngineUnavailable) and not sent:
            logger.warning("a request failed before its first token on %s: %s", engines, error)
            return OpenAIError(
                f"the engine replica is unavailable ({engines}): {error}; retry",
                HTTPStatus.SERVICE_UNAVAILABLE,
                retry_after_s=router.submit_timeout_s,
            )
        logger.warning("a request failed on %s: %r", engines, error)
        return OpenAIError(
            f"the engine replica failed ({engines}): {error}", HTTPStatus.INTERNAL_SERVER_ERROR
        )

    def failure_of(self, opened: Opened, error: Exception, sent: bool) -> OpenAIError:
        """``failure`` of an opened request, named by the engines it ran on."""
        names = "+".join(engine.name for engine in opened.dispatch.engines)
        return self.failure(error, names, sent)

    # ---- release ------------------------------------------------------------------------

    async def release(self) -> None:
        """Once, however the request ended (see the module's docstring)."""
        if self._released:
            return
        self._released = True
        try:
            for dispatch in list(self._running):
                await self._let_go(dispatch)
        finally:
            if self.slot is not None:
                self.slot.release()
            self._turn_over(started=False)
            if self.lifecycle is not None:
                for dispatch in self._opened:
                    self.lifecycle.metrics.prefill_decided(dispatch.decision)
            if self.status is None:
                self.status = CLIENT_CLOSED
            self._count(self)

    def _turn_over(self, started: bool) -> None:
        """Its key's turn given back: at its first token (``started``), else at its end."""
        turn, self.turn = self.turn, None
        if turn is None:
            return
        if started:
            turn.started()
        else:
            turn.release()
        self._model.metrics.key_waiting(self.flow.name, self._priority, -1)

    def _started(self, dispatch: Dispatch) -> None:
        self._running.append(dispatch)
        for engine in dispatch.engines:
            engine.state.in_flight += 1
        self._model.metrics.in_flight(dispatch.engines, started=True)

    async def _let_go(self, dispatch: Dispatch) -> None:
        """Undo ``_started`` and close the stream (which aborts it where it still runs)."""
        if dispatch not in self._running:
            return
        self._running.remove(dispatch)
        for engine in dispatch.engines:
            engine.state.in_flight -= 1
        self._model.metrics.in_flight(dispatch.engines, started=False)
        await dispatch.stream.aclose()

    def _accepted(self) -> None:
        """An engine accepted the request: its time in the router's queue."""
        model = self._model
        model.metrics.queued(model.clock.now() - self.arrival)
