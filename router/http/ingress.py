"""The OpenAI-compatible ingress deployment (FastAPI inside Ray Serve).

One request: parse and validate (OpenAI error body on bad input), tokenize, choose an
engine replica, stream its token deltas back as SSE or one JSON body. A client that
goes away cancels the engine stream, which aborts the request inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vllm.sampling_params import RequestOutputKind
from vllm.utils.gc_utils import freeze_gc_heap

from engines.backends import ENGINE_BACKENDS
from engines.model_source import resolve_model
from engines.protocol import GenerateChunk, GenerateRequest
from engines.settings import EngineSpec
from kv_transfer import KVRouterSide, KVTransferCollector, make_kv_backend
from router.dispatch import Dispatch, Dispatcher, Plan
from router.http.auth import ApiKeys, check_exposure
from router.http.errors import OpenAIError, routing_error_response
from router.http.openapi import describe_request_bodies
from router.http.readiness import Readiness
from router.http.requests import (
    OpenAIRequest,
    PreparedRequest,
    PromptBuilder,
    RequestValidator,
    ServedByVllm,
    parse_request,
)
from router.http.responses import SSE_DONE, EventStreamResponse, ResponseWriter, Transcript
from router.http.vllm_frontend import (
    DispatchingEngineClient,
    FrontendCall,
    FrontendOptions,
    VllmFrontend,
    frontend_config,
    in_daemon_thread,
)
from router.observation.metrics import RouterMetrics
from router.observation.traffic_drift import TrafficDrift
from router.observation.traffic_record import TrafficRecorder
from router.pd_flow import PREFILL_FALLBACK_REASONS, PrefillOutcome
from router.policies.prefill_gate import PrefillGate
from router.policies.qos import ENGINE_PRIORITY, AdmissionControl, Rejection
from router.pool.calibration import calibrate_ttft
from router.pool.engine_client import (
    EngineClient,
    EngineFailed,
    EngineLink,
    EngineUnavailable,
    LocalEngineLink,
    SocketEngineLink,
)
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineStatePoller
from router.pool.replica_state import ReplicaState
from router.pool.watcher import PoolWatcher
from router.settings import IngressSettings, Priority

logger = logging.getLogger("splitserve.router")
REQUEST_ID_HEADER = "x-request-id"

app = FastAPI(title="splitserve router")
app.add_exception_handler(StarletteHTTPException, routing_error_response)
describe_request_bodies(
    app,
    {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest},
)


async def _after(
    first: tuple[GenerateChunk, float], stream: AsyncIterator[GenerateChunk]
) -> AsyncIterator[tuple[GenerateChunk, float]]:
    """The chunk already read, then the rest of the stream, each with when it came."""
    yield first
    async for chunk in stream:
        yield chunk, time.perf_counter()


@serve.ingress(app)
class Router:
    async def __init__(
        self,
        settings: IngressSettings,
        roles: dict[str, str],
        engines: dict[str, Any],
        local_engines: dict[str, EngineSpec] | None = None,
        pool_handles: dict[str, Any] | None = None,
    ) -> None:
        """``engines``: Serve handles by replica name; ``local_engines``: the specs of
        engines this process hosts itself; ``pool_handles``: the Serve handles of scaled
        pools, by deployment name (see deployments/app.py)."""
        from transformers import AutoConfig, AutoTokenizer

        self._config = settings
        model = resolve_model(settings.model)
        self._served_name = model.served_name
        tokenizer = AutoTokenizer.from_pretrained(model.path)
        model_config = AutoConfig.from_pretrained(model.path)
        vocab_size = model_config.vocab_size
        # Until the engines report the context they were given (engines_ready), the
        # configured one or the model's own.
        self._prompts = PromptBuilder(
            tokenizer,
            settings.model.max_model_len or model_config.max_position_embeddings,
            vocab_size,
            settings.router.trust_request_chat_template,
        )
        self._requests = RequestValidator(
            self._prompts, self._served_name, settings.qos.default_priority, settings.router
        )
        self._auth = ApiKeys.from_settings(settings.auth)
        check_exposure(self._auth, settings.http_host, settings.auth.allow_open, logger)
        qos = settings.qos
        # Started side by side; each spawn alone (its processes inherit its environment).
        restarts = settings.router.engine_restart_attempts
        host_class = ENGINE_BACKENDS.get(settings.engine_backend)
        self._local_engines = [
            LocalEngineLink(name, functools.partial(host_class, spec), restarts)
            for name, spec in (local_engines or {}).items()
        ]
        links: dict[str, EngineLink] = {
            name: SocketEngineLink(handle) for name, handle in engines.items()
        }
        links.update(zip(local_engines or {}, self._local_engines, strict=True))
        self._pool = EnginePool(
            [self._pool_member(name, roles[name], link) for name, link in links.items()]
        )
        self._pool.start()
        handles = pool_handles or {}
        self._pool_watcher = PoolWatcher(
            self._pool,
            [(scaled, handles[scaled.deployment]) for scaled in settings.scaled_pools],
            self._pool_member,
        )
        self._pool_watcher.start()
        # Engines load in the background; until all are up the router says so (503), and
        # before it admits anything it times a prefill on each (the TTFT estimate's seed).
        calibration = functools.partial(
            calibrate_ttft, self._pool, qos.calibration_prompt_tokens, vocab_size
        )

        # vLLM's serving layer, for what the router's own path does not render: built
        # once the engines are up (start_frontend).
        self._frontend: VllmFrontend | None = None

        async def engines_ready() -> None:
            await self._adopt_engines_context()
            await calibration()
            await self._start_frontend()
            # What start-up built stays for good: out of the collector's sight, so its
            # sweeps walk only what requests allocate, as `vllm serve` does after start.
            freeze_gc_heap()

        self._readiness = Readiness(
            self._pool, on_engines_ready=engines_ready, members_known=self._pool_watcher.populated
        )
        self._kv: KVRouterSide | None = None
        if settings.kv_transfer is not None:
            self._kv = make_kv_backend(settings.kv_transfer).router_side()
        self._admission = AdmissionControl(settings.qos)
        record = settings.router.traffic_record
        self._recorder = (
            TrafficRecorder(record, settings.router.traffic_record_block_tokens) if record else None
        )
        self._metrics = RouterMetrics()
        profile = settings.router.traffic_profile
        self._drift = (
            TrafficDrift(profile, self._metrics.traffic_drift, self._metrics.traffic_drifted)
            if profile
            else None
        )
        self._mode = settings.strategy
        # Observed once per relayed token: the labelled child is looked up once.
        self._itl = self._metrics.itl.labels(self._mode)
        self._engine_state = EngineStatePoller(
            self._pool,
            self._metrics,
            settings.router.stats_interval_s,
            settings.router.unhealthy_after_failed_polls,
            kv=self._kv,
            ema_weight=qos.ema_weight,
            kv_interval_s=settings.router.kv_metrics_interval_s,
        )
        self._dispatcher = Dispatcher(
            settings, self._pool, self._kv, self._engine_state.transfer_cost.estimate_s
        )
        self._metrics.registry.register(
            KVTransferCollector(lambda: self._engine_state.kv_transfer_snapshot)
        )
        self._engine_state.start()

    def _pool_member(self, name: str, role: str, link: EngineLink) -> EngineClient:
        settings = self._config
        return EngineClient(
            name,
            role,
            link,
            settings.router.submit_timeout_s,
            ReplicaState(
                settings.qos.ema_weight,
                settings.qos.min_prefill_tokens_per_sample,
                kv_events_pending_s=settings.router.kv_events_pending_s,
            ),
            PrefillGate(settings.router.max_prefills_per_engine),
        )

    # ---- routes -------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        return await self._generate(raw, CompletionRequest, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        return await self._generate(raw, ChatCompletionRequest, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(self, raw: Request) -> Response:
        return await self._vllm_route(raw, ResponsesRequest, "/v1/responses")

    @app.post("/tokenize")
    async def tokenize(self, raw: Request) -> Response:
        return await self._vllm_route(raw, TokenizeRequest, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(self, raw: Request) -> Response:
        return await self._vllm_route(raw, DetokenizeRequest, "/detokenize")

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, raw: Request) -> Response:
        listed = await self.models(raw)
        if listed.status_code != HTTPStatus.OK:
            return listed
        if model_id != self._served_name:
            return OpenAIError(
                f"The model '{model_id}' does not exist; this server serves '{self._served_name}'.",
                HTTPStatus.NOT_FOUND,
                "model",
            ).response()
        return JSONResponse(self._model_card().model_dump())

    @app.get("/v1/models")
    async def models(self, raw: Request) -> Response:
        if refused := self._auth.refusal(raw.headers, "/v1/models"):
            return refused.response()
        if not self._readiness.is_ready:
            # Clients take a model list as readiness; vLLM's server does not listen yet.
            self._metrics.requests.labels("/v1/models", "503", "none").inc()
            return self._starting().response()
        self._metrics.requests.labels("/v1/models", "200", "none").inc()
        return JSONResponse(ModelList(data=[self._model_card()]).model_dump())

    def _model_card(self) -> ModelCard:
        return ModelCard(
            id=self._served_name,
            owned_by="splitserve",
            max_model_len=self._prompts.max_model_len,
        )

    @app.get("/health")
    async def health(self, raw: Request) -> Response:
        if refused := self._auth.refusal(raw.headers, "/health"):
            return refused.response()
        replicas = list(self._pool)
        states = await asyncio.gather(*(self._replica_health(r) for r in replicas))
        healthy = self._readiness.is_ready and all(state == "ok" for state in states)
        status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
        overall = "ok" if healthy else "degraded" if self._readiness.is_ready else "starting"
        body = {
            "status": overall,
            # Which router replica answered: an application may run several.
            "router": serve.get_replica_context().replica_id.unique_id,
            "replicas": {r.name: state for r, state in zip(replicas, states, strict=True)},
        }
        return JSONResponse(body, status_code=int(status))

    @app.get("/metrics")
    async def metrics(self, raw: Request) -> Response:
        if refused := self._auth.refusal(raw.headers, "/metrics"):
            return refused.response()
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- one generation request ----------------------------------------------------------

    async def _generate(self, raw: Request, model_cls: type[OpenAIRequest], route: str) -> Response:
        arrival = time.perf_counter()
        request_id = raw.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        # Serve's proxy echoes x-request-id (or creates one) on every response itself.
        headers: dict[str, str] = {}
        priority = self._config.qos.default_priority
        try:
            client = self._auth.authenticate(raw.headers, route)  # 401/403 before the body
            raw_body = await self._requests.receive(raw.headers, raw.stream())
            priority, body = await self._requests.read_off_loop(raw_body, raw.headers)
            priority, waiting = self._auth.admit(client, priority, self._metrics)
            # Before the costly part (validation, tokenization): a priority whose queue
            # alone already breaks its limit is refused here, in microseconds, so that a
            # burst's refusals do not wait behind its admitted requests' parsing.
            self._admit_early(priority)
            try:
                prepared = await self._requests.prepare_off_loop(model_cls, body, len(raw_body))
            except ServedByVllm as routed:
                call = FrontendCall(route, arrival, priority, request_id)
                call.on_first_token = waiting.release
                return await self._serve_by_vllm(routed.request, raw, call)
            engine_request = GenerateRequest(
                # vLLM needs ids unique among running requests; clients may reuse theirs.
                request_id=f"{request_id}-{uuid.uuid4().hex[:8]}",
                subscriber="",  # set by the EngineClient that submits it
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=prepared.sampling_params,
                priority=ENGINE_PRIORITY[priority],
                deadline=self._deadline(),
            )
            if not await self._readiness.wait(self._config.router.ready_wait_s):
                raise self._starting()
            plan = self._dispatcher.plan(engine_request, priority)
            self._admit(plan)
        except OpenAIError as error:
            self._metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response(headers)
        chat = model_cls is ChatCompletionRequest
        writer = ResponseWriter(
            chat=chat,
            model=self._served_name,
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            return_token_ids=prepared.return_token_ids,
        )
        tried: list[str] = []
        try:
            dispatch, first = await self._open(plan, arrival, tried)
        except Exception as error:  # nothing was sent yet: the status says what happened
            logger.warning("a request failed before its first token: %s", error)
            failure = self._failure(error, " then ".join(tried), started=False)
            self._metrics.requests.labels(route, str(int(failure.status)), priority).inc()
            return failure.response(headers)
        waiting.release()  # the key's request has its first token: no longer queued
        self._count_choices(dispatch.plan)
        headers.update(dispatch.response_headers())
        events = self._events(dispatch, first, prepared, writer, arrival)
        if prepared.stream:
            self._metrics.requests.labels(route, "200", priority).inc()
            # Closed by the response however it ends, even if it never started streaming.
            return EventStreamResponse(
                events, headers, on_close=functools.partial(self._release, dispatch)
            )
        return await self._collect(events, writer, route, headers, priority)

    # ---- requests vLLM's serving layer answers -----------------------------------------

    async def _vllm_route(self, raw: Request, model_cls: type[Any], route: str) -> Response:
        """A route only vLLM's layer serves (Responses, tokenize, detokenize): the same
        keys, limits and admission as the completion routes, then vLLM's answer."""
        arrival = time.perf_counter()
        request_id = raw.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        priority = self._config.qos.default_priority
        try:
            client = self._auth.authenticate(raw.headers, route)
            raw_body = await self._requests.receive(raw.headers, raw.stream())
            priority, body = await self._requests.read_off_loop(raw_body, raw.headers)
            priority, waiting = self._auth.admit(client, priority, self._metrics)
            self._admit_early(priority)
            request = parse_request(model_cls, body, self._config.router.unknown_fields)
        except OpenAIError as error:
            self._metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response()
        call = FrontendCall(route, arrival, priority, request_id)
        call.on_first_token = waiting.release
        return await self._serve_by_vllm(request, raw, call)

    async def _serve_by_vllm(self, request: Any, raw: Request, call: FrontendCall) -> Response:
        try:
            if not await self._readiness.wait(self._config.router.ready_wait_s):
                raise self._starting()
            assert self._frontend is not None  # built before the router is ready
            response, status = await self._frontend.serve(request, raw, call)
        except OpenAIError as error:
            response, status = error.response(), error.status
        finally:
            if call.on_first_token is not None:
                call.on_first_token()  # released once, whenever it ends before a token
        self._metrics.requests.labels(call.route, str(int(status)), call.priority).inc()
        return response

    def _deadline(self) -> float:
        """When a request starting now is given up and aborted (event-loop time)."""
        return asyncio.get_running_loop().time() + self._config.router.request_timeout_s

    async def _start_frontend(self) -> None:
        """vLLM's configuration and serving classes (seconds), in a daemon thread: a
        router stopped meanwhile must not wait for it to exit, and it runs after the
        engines' own start, never beside it (vLLM's start-up is not made to run twice
        at once in one process)."""
        vllm_config = await in_daemon_thread(frontend_config, self._config.model)
        # What the engines reported (their rules), which the router refuses beyond.
        vllm_config.model_config.max_model_len = self._prompts.max_model_len
        client = DispatchingEngineClient(vllm_config, self._open_for_vllm)
        options = FrontendOptions.of(
            self._config.model, self._config.router.trust_request_chat_template
        )
        self._frontend = await in_daemon_thread(VllmFrontend, client, options)

    async def _open_for_vllm(
        self, request: GenerateRequest, call: FrontendCall
    ) -> tuple[AsyncIterator[GenerateChunk], dict[str, str]]:
        """Plan, admit and start one request vLLM's layer made; its first chunk is read
        here, so a refusal or failure before it becomes ``call.error`` (its own status)."""
        request.priority = ENGINE_PRIORITY[call.priority]
        request.deadline = self._deadline()
        tried: list[str] = []
        try:
            plan = self._dispatcher.plan(request, call.priority)
            self._admit(plan)
            dispatch, first = await self._open(plan, call.arrival, tried)
        except OpenAIError as error:
            call.error = error
            raise
        except Exception as error:
            logger.warning("a request failed before its first token: %s", error)
            call.error = self._failure(error, " then ".join(tried), started=False)
            raise
        self._count_choices(dispatch.plan)
        streamed = request.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        relay = self._relay(dispatch, first, call, streamed)
        return relay, dispatch.response_headers()

    async def _relay(
        self,
        dispatch: Dispatch,
        first: tuple[GenerateChunk, float],
        call: FrontendCall,
        streamed: bool,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """The dispatch's chunks, timed and counted as the router's own path does."""
        last_token_at: float | None = None
        generated = 0
        try:
            async for chunk, now in _after(first, dispatch.stream):
                if chunk.token_ids and streamed:
                    self._observe_token_timing(call.arrival, last_token_at, now, dispatch.outcome)
                    last_token_at = now
                if not generated and chunk.token_ids:
                    self._observe_prefix_estimate(dispatch, chunk)
                generated += len(chunk.token_ids)
                yield chunk
            self._account(dispatch, call.arrival, dispatch.plan.request.prompt_token_ids, generated)
        except Exception as error:
            names = "+".join(replica.name for replica in dispatch.replicas)
            logger.exception("a request failed on %s", names)
            if not streamed:  # nothing was sent: the response is this status
                call.error = self._failure(error, names, started=False)
            raise
        finally:
            await self._release(dispatch)

    def _account(
        self, dispatch: Dispatch, arrival: float, prompt_token_ids: list[int], generated: int
    ) -> None:
        """A finished request in the router's metrics, traffic record and drift."""
        self._metrics.e2e.labels(self._mode).observe(time.perf_counter() - arrival)
        self._metrics.tokens.labels("prompt").inc(len(prompt_token_ids))
        self._metrics.tokens.labels("generation").inc(generated)
        if self._recorder is not None:
            self._recorder.record(arrival, prompt_token_ids, generated, dispatch.plan.priority)
        if self._drift is not None:
            self._drift.observe(arrival, len(prompt_token_ids), generated)

    async def _open(
        self, plan: Plan, arrival: float, tried: list[str]
    ) -> tuple[Dispatch, tuple[GenerateChunk, float]]:
        """Start the plan and wait for its first chunk (and when it came), so that a
        failure before it is an HTTP status, and a DP request whose replica was
        unavailable is re-planned once on another healthy replica (nothing was sent).
        ``tried``: each replica that was asked first, in order, for the error's message."""
        retried = False
        while True:
            tried.append(plan.prefill_replica.name)
            dispatch = self._dispatcher.start(plan, on_accepted=self._queue_timer(arrival))
            self._track(dispatch.replicas, +1)
            try:
                chunk = await anext(dispatch.stream, None)
                if chunk is None:
                    raise EngineFailed("the engine ended the request without output")
                return dispatch, (chunk, time.perf_counter())
            except BaseException as error:
                await self._release(dispatch)
                elsewhere = None
                if isinstance(error, EngineUnavailable) and not retried:
                    elsewhere = self._dispatcher.replan_elsewhere(plan)
                if elsewhere is None:
                    raise
                logger.warning(
                    "%s unavailable (%s); retrying on %s",
                    plan.main.replica.name,
                    error,
                    elsewhere.main.replica.name,
                )
                plan, retried = elsewhere, True

    async def _release(self, dispatch: Dispatch) -> None:
        """Once per dispatch, however the request ends: close its stream (which aborts
        it in the engine if it still runs) and count it."""
        if dispatch.released:
            return
        dispatch.released = True
        self._track(dispatch.replicas, -1)
        await dispatch.stream.aclose()
        outcome = dispatch.outcome
        self._metrics.prefill_decisions.labels(outcome.where, outcome.reason).inc()

    def _admit_early(self, priority: Priority) -> None:
        if not self._readiness.is_ready:
            return  # nothing measured yet; the request waits for readiness below
        earliest = self._dispatcher.earliest_ttft_s(priority)
        try:
            self._admission.check(priority, self._dispatcher.queued_requests(), earliest)
        except Rejection as rejection:
            self._metrics.rejections.labels(rejection.reason, priority).inc()
            raise

    def _admit(self, plan: Plan) -> None:
        estimate = plan.ttft_estimate_s()
        if estimate is not None:
            self._metrics.ttft_estimate.labels(plan.prefill_replica.name).set(estimate)
        try:
            self._admission.check(plan.priority, self._dispatcher.queued_requests(), estimate)
        except Rejection as rejection:
            self._metrics.rejections.labels(rejection.reason, plan.priority).inc()
            raise

    def _queue_timer(self, arrival: float) -> Callable[[], None]:
        def accepted() -> None:
            self._metrics.queue.labels(self._mode).observe(time.perf_counter() - arrival)

        return accepted

    def _count_choices(self, plan: Plan) -> None:
        for choice, prefill in ((plan.main, False), (plan.prefill, True)):
            if choice is not None:
                replica = choice.replica
                policy = self._dispatcher.policy_of(choice, prefill)
                self._metrics.replica_choices.labels(
                    replica.role, policy, replica.name, choice.reason
                ).inc()

    async def _collect(
        self,
        events: AsyncIterator[Transcript | str],
        writer: ResponseWriter,
        route: str,
        headers: dict[str, str],
        priority: Priority,
    ) -> Response:
        transcript: Transcript | None = None
        try:
            async for item in events:
                if isinstance(item, Transcript):
                    transcript = item
        except OpenAIError as error:
            self._metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response(headers)
        assert transcript is not None
        self._metrics.requests.labels(route, "200", priority).inc()
        return JSONResponse(writer.final_response(transcript), headers=headers)

    async def _events(
        self,
        dispatch: Dispatch,
        first: tuple[GenerateChunk, float],
        prepared: PreparedRequest,
        writer: ResponseWriter,
        arrival: float,
    ) -> AsyncGenerator[Any, None]:
        """SSE strings when streaming; for non-stream requests, the final Transcript.
        ``first``: the stream's first chunk, already read (``_open``), and when."""
        transcript = Transcript(prompt_token_ids=prepared.prompt_token_ids)
        last_token_at: float | None = None
        # Closing the stream early (client gone) aborts the request in the engine.
        stream = dispatch.stream
        try:
            if prepared.stream and (opening := writer.first_event(transcript)):
                yield opening
            async for chunk, now in _after(first, stream):
                if chunk.token_ids and prepared.stream:
                    self._observe_token_timing(arrival, last_token_at, now, dispatch.outcome)
                    last_token_at = now
                is_first = not transcript.token_ids
                if is_first:
                    self._observe_prefix_estimate(dispatch, chunk)
                transcript.add(chunk)
                if prepared.stream:
                    yield writer.delta_event(chunk, transcript, is_first)
            self._account(dispatch, arrival, transcript.prompt_token_ids, len(transcript.token_ids))
            if not prepared.stream:
                yield transcript
                return
            if prepared.include_usage:
                yield writer.usage_event(transcript)
            yield SSE_DONE
        except Exception as error:  # the engine failed mid-request
            names = "+".join(replica.name for replica in dispatch.replicas)
            logger.exception("a request failed on %s", names)
            # A non-streamed response has sent nothing yet, whatever the engines made.
            sent = prepared.stream and bool(transcript.token_ids)
            failure = self._failure(error, names, started=sent)
            if not prepared.stream:
                raise failure from error
            yield writer.error_event(failure)
            yield SSE_DONE
        finally:
            await self._release(dispatch)

    def _starting(self) -> OpenAIError:
        waiting = ", ".join(self._readiness.starting()) or "the router"
        return OpenAIError(
            f"the model is not ready yet: {waiting} starting; retry",
            HTTPStatus.SERVICE_UNAVAILABLE,
            retry_after_s=max(1.0, self._config.router.ready_wait_s),
        )

    def _failure(self, error: Exception, names: str, started: bool) -> OpenAIError:
        """503 with Retry-After where an engine was unavailable before the client got
        any token, 504 past the request timeout, else 500."""
        if isinstance(error, TimeoutError):
            return OpenAIError(
                f"the request did not finish within router.request_timeout_s"
                f" ({self._config.router.request_timeout_s:g} s) on {names}; it was aborted",
                HTTPStatus.GATEWAY_TIMEOUT,
            )
        if isinstance(error, EngineUnavailable) and not started:
            return OpenAIError(
                f"the engine replica is unavailable ({names}): {error}; retry",
                HTTPStatus.SERVICE_UNAVAILABLE,
                retry_after_s=self._config.router.submit_timeout_s,
            )
        return OpenAIError(
            f"the engine replica failed ({names}): {error}", HTTPStatus.INTERNAL_SERVER_ERROR
        )

    def _observe_prefix_estimate(self, dispatch: Dispatch, chunk: GenerateChunk) -> None:
        """Set the router's prefix-cache estimate beside what vLLM found, per replica."""
        if dispatch.outcome.reason in PREFILL_FALLBACK_REASONS:
            return  # another replica computed the prompt than the one estimated for
        name = dispatch.prefill_replica.name
        tokens = self._metrics.prefix_cache_tokens
        tokens.labels(name, "estimated").inc(dispatch.expected_cached_tokens)
        tokens.labels(name, "reported").inc(chunk.num_cached_tokens)
        for signal, estimate in dispatch.plan.cached_by_signal.items():
            tokens.labels(name, signal).inc(estimate)
            error = abs(estimate - chunk.num_cached_tokens)
            self._metrics.prefix_estimate_error.labels(signal).observe(error)

    def _observe_token_timing(
        self, arrival: float, last_token_at: float | None, now: float, outcome: PrefillOutcome
    ) -> None:
        if last_token_at is None:
            self._metrics.ttft.labels(self._mode, outcome.where).observe(now - arrival)
        else:
            self._itl.observe(now - last_token_at)

    def _track(self, replicas: list[EngineClient], delta: int) -> None:
        for replica in replicas:
            replica.in_flight += delta
            labels = (replica.name, replica.role)
            self._metrics.replica_in_flight.labels(*labels).set(replica.in_flight)
            if delta > 0:
                self._metrics.replica_requests.labels(*labels).inc()

    async def check_health(self) -> None:
        # Serve restarts this replica when this raises. An engine in this process that
        # dies is restarted here (LocalEngineLink) while the others serve; only one that
        # will not start again takes its router, and so every engine, with it.
        for link in self._local_engines:
            with contextlib.suppress(EngineFailed):
                await link.check_health()  # a dead engine starts its own replacement
            if link.gave_up:
                raise RuntimeError("an engine of this router could not be restarted")

    def __del__(self) -> None:
        # Stopping, not dying: no engine is restarted and no stream reconnects from here.
        watcher = getattr(self, "_pool_watcher", None)
        if watcher is not None:
            watcher.stop()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()
        kv = getattr(self, "_kv", None)
        if kv is not None:
            kv.shutdown()  # what the KV backend holds for this application goes with it

    async def _adopt_engines_context(self) -> None:
        """Take the context length the engines derived (vLLM's rules: the model's own,
        capped by max_model_len), so the router refuses what they would refuse."""
        stats = await asyncio.gather(*(replica.link.stats() for replica in self._pool))
        reported = [s.max_model_len for s in stats if s.max_model_len]
        if reported and min(reported) != self._prompts.max_model_len:
            logger.info("the engines' context is %d tokens", min(reported))
            self._prompts.max_model_len = min(reported)

    async def _replica_health(self, replica: EngineClient) -> str:
        if not replica.link.ready:
            return "starting"
        timeout = self._config.router.health_check_timeout_s
        try:
            await asyncio.wait_for(replica.link.check_health(), timeout)
        except Exception as error:
            return f"unhealthy: {type(error).__name__}"
        return "ok"
