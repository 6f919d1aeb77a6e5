"""The OpenAI-compatible ingress deployment (FastAPI inside Ray Serve).

One request: parse and validate (OpenAI error body on bad input), tokenize, choose an
engine replica, stream its token deltas back as SSE or one JSON body. A client that
goes away cancels the engine stream, which aborts the request inside vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
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
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

from engines.backends import ENGINE_BACKENDS
from engines.model_source import resolve_model
from engines.protocol import GenerateChunk, GenerateRequest
from engines.settings import EngineSpec
from kv_transfer import KVRouterSide, KVTransferCollector, make_kv_backend
from router.dispatch import Dispatch, Dispatcher, Plan
from router.engine_client import (
    EngineClient,
    EngineFailed,
    EngineLink,
    EngineUnavailable,
    LocalEngineLink,
    ServeEngineLink,
)
from router.engine_state import EngineStatePoller
from router.errors import OpenAIError, bad_request
from router.metrics import RouterMetrics
from router.pd import PREFILL_FALLBACK_REASONS, PrefillOutcome
from router.qos import ENGINE_PRIORITY, AdmissionControl, Rejection, take_priority
from router.replica_state import ReplicaState
from router.requests import OpenAIRequest, PreparedRequest, PromptBuilder, parse_request
from router.responses import SSE_DONE, EventStreamResponse, ResponseWriter, Transcript
from router.settings import IngressSettings, Priority

logger = logging.getLogger("splitserve.router")
REQUEST_ID_HEADER = "x-request-id"

app = FastAPI(title="splitserve router")


async def _json_body(raw: Request) -> Any:
    body = await raw.body()
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"malformed JSON in the request body: {error}") from None
    # Valid UTF-8 bytes can still spell a lone UTF-16 surrogate as a \u escape, which no
    # tokenizer or UTF-8 writer takes; the byte test keeps the full check off most bodies.
    if b"\\ud" in body.lower() and not _encodable(parsed):
        raise bad_request("the request holds a lone UTF-16 surrogate (\\ud800-\\udfff)")
    return parsed


def _encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _until(
    stream: AsyncIterator[GenerateChunk], deadline: float
) -> AsyncIterator[GenerateChunk]:
    """The stream's chunks until the event loop's clock reaches ``deadline``; then
    TimeoutError (the caller closes the stream, which aborts the request)."""
    async with asyncio.timeout_at(deadline):
        async for chunk in stream:
            yield chunk


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(app)
class Router:
    async def __init__(
        self,
        settings: IngressSettings,
        roles: dict[str, str],
        engines: dict[str, Any],
        local_engines: dict[str, EngineSpec] | None = None,
    ) -> None:
        """``engines``: Serve handles by replica name; ``local_engines``: the specs of
        engines this process hosts itself (see deployments/app.py)."""
        from transformers import AutoConfig, AutoTokenizer

        self._config = settings
        model = resolve_model(settings.model)
        self._served_name = model.served_name
        tokenizer = AutoTokenizer.from_pretrained(model.path)
        vocab_size = AutoConfig.from_pretrained(model.path).vocab_size
        self._prompts = PromptBuilder(tokenizer, settings.model.max_model_len, vocab_size)
        submit_timeout_s = settings.router.submit_timeout_s
        qos = settings.qos
        # One after another: each engine's processes inherit its environment at spawn.
        restarts = settings.router.engine_restart_attempts
        host_class = ENGINE_BACKENDS.get(settings.engine_backend)
        self._local_engines = [
            LocalEngineLink(name, functools.partial(host_class, spec), restarts)
            for name, spec in (local_engines or {}).items()
        ]
        links: dict[str, EngineLink] = {
            name: ServeEngineLink(handle) for name, handle in engines.items()
        }
        links.update(zip(local_engines or {}, self._local_engines, strict=True))
        self._replicas = [
            EngineClient(
                name,
                roles[name],
                link,
                submit_timeout_s,
                ReplicaState(qos.ema_weight, qos.min_prefill_tokens_per_sample),
            )
            for name, link in links.items()
        ]
        for replica in self._replicas:
            replica.start()
        self._kv: KVRouterSide | None = None
        if settings.kv_transfer is not None:
            self._kv = make_kv_backend(settings.kv_transfer).router_side()
        self._dispatcher = Dispatcher(settings, self._replicas, self._kv)
        self._admission = AdmissionControl(settings.qos)
        self._metrics = RouterMetrics()
        self._mode = settings.strategy
        self._engine_state = EngineStatePoller(
            self._replicas,
            self._metrics,
            settings.router.stats_interval_s,
            settings.router.unhealthy_after_failed_polls,
            kv=self._kv,
        )
        self._metrics.registry.register(
            KVTransferCollector(lambda: self._engine_state.kv_transfer_snapshot)
        )
        self._engine_state.start()

    # ---- routes -------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        return await self._generate(raw, CompletionRequest, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        return await self._generate(raw, ChatCompletionRequest, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        card = ModelCard(
            id=self._served_name,
            owned_by="splitserve",
            max_model_len=self._config.model.max_model_len,
        )
        self._metrics.requests.labels("/v1/models", "200", "none").inc()
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health(self) -> JSONResponse:
        states = await asyncio.gather(*(self._replica_health(r) for r in self._replicas))
        healthy = all(state == "ok" for state in states)
        status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
        body = {
            "status": "ok" if healthy else "degraded",
            # Which router replica answered: an application may run several.
            "router": serve.get_replica_context().replica_id.unique_id,
            "replicas": {r.name: state for r, state in zip(self._replicas, states, strict=True)},
        }
        return JSONResponse(body, status_code=int(status))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- one generation request ----------------------------------------------------------

    async def _generate(self, raw: Request, model_cls: type[OpenAIRequest], route: str) -> Response:
        arrival = time.perf_counter()
        request_id = raw.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        # Serve's proxy echoes x-request-id (or creates one) on every response itself.
        headers: dict[str, str] = {}
        priority = self._config.qos.default_priority
        try:
            body = await _json_body(raw)
            priority = take_priority(body, raw.headers, priority)
            request = parse_request(model_cls, body)
            self._check_model(request.model)
            prepared = self._prompts.prepare(request)
            engine_request = GenerateRequest(
                # vLLM needs ids unique among running requests; clients may reuse theirs.
                request_id=f"{request_id}-{uuid.uuid4().hex[:8]}",
                subscriber="",  # set by the EngineClient that submits it
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=prepared.sampling_params,
                priority=ENGINE_PRIORITY[priority],
                deadline=asyncio.get_running_loop().time() + self._config.router.request_timeout_s,
            )
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
        dispatch = self._dispatcher.start(plan, on_accepted=self._queue_timer(arrival))
        self._count_choices(plan)
        headers.update(dispatch.headers)
        events = self._events(dispatch, prepared, writer, arrival)
        if prepared.stream:
            self._metrics.requests.labels(route, "200", priority).inc()
            return EventStreamResponse(events, headers)
        return await self._collect(events, writer, route, headers, priority)

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
        for choice in (plan.main, plan.prefill):
            if choice is not None:
                replica = choice.replica
                policy = self._dispatcher.policy_of(replica.role)
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
        prepared: PreparedRequest,
        writer: ResponseWriter,
        arrival: float,
    ) -> AsyncGenerator[Any, None]:
        """SSE strings when streaming; for non-stream requests, the final Transcript."""
        transcript = Transcript(prompt_token_ids=prepared.prompt_token_ids)
        self._track(dispatch.replicas, +1)
        last_token_at: float | None = None
        # Closing `stream` early (client gone) aborts the request in the engine.
        stream = dispatch.stream
        try:
            if prepared.stream and (opening := writer.first_event(transcript)):
                yield opening
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.token_ids and prepared.stream:
                    self._observe_token_timing(arrival, last_token_at, now, dispatch.outcome)
                    last_token_at = now
                first = not transcript.token_ids
                if first:
                    self._observe_prefix_estimate(dispatch, chunk)
                transcript.add(chunk)
                if prepared.stream:
                    yield writer.delta_event(chunk, transcript, first)
            self._metrics.e2e.labels(self._mode).observe(time.perf_counter() - arrival)
            self._metrics.tokens.labels("prompt").inc(len(transcript.prompt_token_ids))
            self._metrics.tokens.labels("generation").inc(len(transcript.token_ids))
            if not prepared.stream:
                yield transcript
                return
            if prepared.include_usage:
                yield writer.usage_event(transcript)
            yield SSE_DONE
        except Exception as error:  # the engine failed mid-request
            names = "+".join(replica.name for replica in dispatch.replicas)
            logger.exception("a request failed on %s", names)
            failure = self._failure(error, names, started=bool(transcript.token_ids))
            if not prepared.stream:
                raise failure from error
            yield writer.error_event(failure)
            yield SSE_DONE
        finally:
            self._track(dispatch.replicas, -1)
            await stream.aclose()
            outcome = dispatch.outcome
            self._metrics.prefill_decisions.labels(outcome.where, outcome.reason).inc()

    def _failure(self, error: Exception, names: str, started: bool) -> OpenAIError:
        """503 with Retry-After where the engine never took the request, 504 past the
        request timeout, else 500."""
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

    def _observe_token_timing(
        self, arrival: float, last_token_at: float | None, now: float, outcome: PrefillOutcome
    ) -> None:
        if last_token_at is None:
            self._metrics.ttft.labels(self._mode, outcome.where).observe(now - arrival)
        else:
            self._metrics.itl.labels(self._mode).observe(now - last_token_at)

    def _track(self, replicas: list[EngineClient], delta: int) -> None:
        for replica in replicas:
            replica.in_flight += delta
            labels = (replica.name, replica.role)
            self._metrics.replica_in_flight.labels(*labels).set(replica.in_flight)
            if delta > 0:
                self._metrics.replica_requests.labels(*labels).inc()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._served_name:
            raise OpenAIError(
                f"The model '{model}' does not exist; this server serves '{self._served_name}'.",
                HTTPStatus.NOT_FOUND,
                "model",
            )

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
        for link in getattr(self, "_local_engines", ()):
            link.shutdown()
        kv = getattr(self, "_kv", None)
        if kv is not None:
            kv.shutdown()  # what the KV backend holds for this application goes with it

    async def _replica_health(self, replica: EngineClient) -> str:
        timeout = self._config.router.health_check_timeout_s
        try:
            await asyncio.wait_for(replica.link.check_health(), timeout)
        except Exception as error:
            return f"unhealthy: {type(error).__name__}"
        return "ok"
