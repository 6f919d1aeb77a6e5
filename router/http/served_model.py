"""One model the router serves: its engines, its policies, and a request's way through
them, from a parsed body to the response.

The ingress (router/http/ingress.py) authenticates, reads the body and finds the model
it names; everything after that is this model's own: its pools, prefill policy, QoS, tokenizer
and vLLM serving layer, so that two models in one application share nothing but the
router's process, its API keys and its metrics registry (with a ``model`` label).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NoReturn

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.sampling_params import RequestOutputKind
from vllm.utils.gc_utils import freeze_gc_heap

from engines.contract import EngineFailed, EngineUnavailable
from engines.model_source import resolve_model
from engines.protocol import GenerateChunk, GenerateRequest, LoraAdapter
from router.dispatch import Dispatch, Plan
from router.http.auth import QueueSlot
from router.http.errors import OpenAIError, Rejection
from router.http.relay import Relay
from router.http.requests import (
    OpenAIRequest,
    PromptBuilder,
    RequestValidator,
    ServedByVllm,
    parse_request,
    take_priority,
)
from router.http.responses import EventStreamResponse, ResponseWriter
from router.http.vllm_frontend import (
    DispatchingEngineClient,
    FrontendCall,
    FrontendOptions,
    VllmFrontend,
    frontend_config,
    in_daemon_thread,
)
from router.observation.metrics import ModelMetrics
from router.observation.requests import RequestObserver
from router.policies.qos import ENGINE_PRIORITY, Refusal
from router.pool.calibration import calibrate_ttft
from router.pool.pooled_engine import PooledEngine
from router.runtime import build_runtime
from router.settings import ModelBinding, Priority

logger = logging.getLogger("splitserve.router")


async def _remove_adapter(replicas: list[PooledEngine], adapter: LoraAdapter) -> None:
    """Free ``adapter`` on these engines; one that cannot is gone or restarting, and holds
    nothing then."""
    for replica in replicas:
        replica.adapters.discard(adapter.name)
    results = await asyncio.gather(
        *(replica.link.remove_lora(adapter) for replica in replicas), return_exceptions=True
    )
    for replica, result in zip(replicas, results, strict=True):
        if isinstance(result, Exception):
            logger.warning("%s did not free adapter %s: %s", replica.name, adapter.name, result)


class StartOrder:
    """vLLM's start-up work is not made to run twice at once in one process: every
    model's serving layer is built once every model's engines are up, one at a time."""

    def __init__(self, models: int) -> None:
        self._waiting = models
        self._unbuilt = models
        self._all_engines_up = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()

    async def after_every_engine(self, build: Callable[[], Awaitable[None]]) -> None:
        self._waiting -= 1
        if self._waiting <= 0:
            self._all_engines_up.set()
        await self._all_engines_up.wait()
        async with self._one_at_a_time:
            try:
                await build()
            finally:
                self._unbuilt -= 1
                if not self._unbuilt:
                    # What start-up built stays for good: out of the collector's sight,
                    # so its sweeps walk only what requests allocate, as `vllm serve`
                    # does after start.
                    freeze_gc_heap()


@dataclass(slots=True)
class Arrival:
    """A request as the ingress hands it over: read, authenticated, its model found."""

    raw: Request
    route: str
    arrival: float
    request_id: str
    priority: Priority
    waiting: QueueSlot  # its place in its API key's queue, released at the first token
    body_bytes: int


class ServedModel:
    def __init__(
        self, binding: ModelBinding, metrics: ModelMetrics, start_order: StartOrder
    ) -> None:
        """``binding``: the model's settings and engines (router/runtime.py builds what
        it routes with from them)."""
        from transformers import AutoConfig, AutoTokenizer

        settings = binding.settings
        self._config = settings
        model = resolve_model(settings.model)
        self.name = model.served_name
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
        self.requests = RequestValidator(
            self._prompts, self.name, settings.router, is_adapter=self.is_adapter
        )
        # Adapters loaded on the engines, by vLLM's id for them.
        self._adapters: dict[int, LoraAdapter] = {}
        # vLLM's serving layer, for what the router's own path does not render: built
        # once the engines are up (start_frontend).
        self._frontend: VllmFrontend | None = None

        async def engines_ready() -> None:
            # Before it admits anything the router times a prefill on each engine (the
            # TTFT estimate's seed).
            await self._adopt_engines_context()
            await calibrate_ttft(self.pool, settings.qos.calibration_prompt_tokens, vocab_size)
            await start_order.after_every_engine(self._start_frontend)

        runtime = build_runtime(binding, metrics, engines_ready)
        self._runtime = runtime
        self.pool, self.local_engines = runtime.pool, runtime.local_engines
        self.readiness, self.engine_state = runtime.readiness, runtime.engine_state
        self._dispatcher, self._admission = runtime.dispatcher, runtime.admission
        self.metrics = metrics
        self._observer = RequestObserver(
            metrics, settings.shape, runtime.dispatcher, runtime.recorder, runtime.drift
        )
        self._relay = Relay(self._observer, metrics, self._failure)

    @property
    def runtime_lora_updates(self) -> bool:
        return self._config.model.runtime_lora_updates

    @property
    def default_priority(self) -> Priority:
        return self._config.qos.default_priority

    @property
    def kv_namespace(self) -> str | None:
        """Where its handed-over KV is kept (PD and auto), which models may share."""
        kv = self._config.kv_transfer
        return None if kv is None else str(getattr(kv.settings, "namespace", kv.backend))

    def priority_of(self, body: Any, headers: Any) -> Priority:
        return take_priority(body, headers, self.default_priority)

    # ---- one generation request ----------------------------------------------------------

    async def generate(self, call: Arrival, body: Any, model_cls: type[OpenAIRequest]) -> Response:
        route, arrival, priority, waiting = call.route, call.arrival, call.priority, call.waiting
        headers: dict[str, str] = {}
        try:
            # Before the costly part (validation, tokenization): a priority whose queue
            # alone already breaks its limit is refused here, in microseconds, so that a
            # burst's refusals do not wait behind its admitted requests' parsing.
            self._admit_early(priority)
            try:
                prepared = await self.requests.prepare_off_loop(model_cls, body, call.body_bytes)
            except ServedByVllm as routed:
                vllm_call = FrontendCall(route, arrival, priority, call.request_id)
                vllm_call.on_first_token = waiting.release
                return await self._serve_by_vllm(routed.request, call.raw, vllm_call)
            engine_request = GenerateRequest(
                # vLLM needs ids unique among running requests; clients may reuse theirs.
                request_id=f"{call.request_id}-{uuid.uuid4().hex[:8]}",
                subscriber="",  # set by the PooledEngine that submits it
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=prepared.sampling_params,
                priority=ENGINE_PRIORITY[priority],
                deadline=self._deadline(),
            )
            if not await self.readiness.wait(self._config.router.ready_wait_s):
                raise self.starting()
            plan = self._dispatcher.plan(engine_request, priority)
            self._admit(plan)
        except OpenAIError as error:
            self.metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response(headers)
        chat = model_cls is ChatCompletionRequest
        writer = ResponseWriter(
            chat=chat,
            model=self.name,
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{call.request_id}",
            return_token_ids=prepared.return_token_ids,
        )
        tried: list[str] = []
        try:
            dispatch, first = await self._open(plan, arrival, tried)
        except Exception as error:  # nothing was sent yet: the status says what happened
            logger.warning("a request failed before its first token: %s", error)
            failure = self._failure(error, " then ".join(tried), started=False)
            self.metrics.requests.labels(route, str(int(failure.status)), priority).inc()
            return failure.response(headers)
        waiting.release()  # the key's request has its first token: no longer queued
        self._observer.choices(dispatch.plan)
        headers.update(dispatch.response_headers())
        events = self._relay.events(dispatch, first, prepared, writer, arrival)
        if prepared.stream:
            self.metrics.requests.labels(route, "200", priority).inc()
            # Closed by the response however it ends, even if it never started streaming.
            return EventStreamResponse(
                events, headers, on_close=functools.partial(self._relay.release, dispatch)
            )
        return await self._relay.collect(events, writer, route, headers, priority)

    # ---- requests vLLM's serving layer answers -----------------------------------------

    async def serve_by_vllm(self, call: Arrival, body: Any, model_cls: type[Any]) -> Response:
        """A route only vLLM's layer serves (Responses, tokenize, detokenize): the same
        keys, limits and admission as the completion routes, then vLLM's answer."""
        try:
            self._admit_early(call.priority)
            request = parse_request(model_cls, body, self._config.router.unknown_fields)
        except OpenAIError as error:
            self.metrics.requests.labels(call.route, str(int(error.status)), call.priority).inc()
            call.waiting.release()
            return error.response()
        vllm_call = FrontendCall(call.route, call.arrival, call.priority, call.request_id)
        vllm_call.on_first_token = call.waiting.release
        return await self._serve_by_vllm(request, call.raw, vllm_call)

    async def _serve_by_vllm(self, request: Any, raw: Request, call: FrontendCall) -> Response:
        try:
            if not await self.readiness.wait(self._config.router.ready_wait_s):
                raise self.starting()
            assert self._frontend is not None  # built before the router is ready
            response, status = await self._frontend.serve(request, raw, call)
        except OpenAIError as error:
            response, status = error.response(), error.status
        finally:
            if call.on_first_token is not None:
                call.on_first_token()  # released once, whenever it ends before a token
        self.metrics.requests.labels(call.route, str(int(status)), call.priority).inc()
        return response

    def _deadline(self) -> float:
        """When a request starting now is given up and aborted (event-loop time)."""
        return asyncio.get_running_loop().time() + self._config.router.request_timeout_s

    async def _start_frontend(self) -> None:
        """vLLM's configuration and serving classes (seconds), in a daemon thread: a
        router stopped meanwhile must not wait for it to exit, and it runs after the
        engines' own start, never beside it (vLLM's start-up is not made to run twice
        at once in one process)."""
        settings = self._config
        vllm_config = await in_daemon_thread(
            frontend_config, settings.model, settings.generating_engine_kwargs
        )
        # What the engines reported (their rules), which the router refuses beyond.
        vllm_config.model_config.max_model_len = self._prompts.max_model_len
        loader = self if self._config.model.lora_enabled else None
        client = DispatchingEngineClient(vllm_config, self._open_for_vllm, loader)
        options = FrontendOptions.of(
            self._config.model, self._config.router.trust_request_chat_template
        )
        frontend = await in_daemon_thread(VllmFrontend, client, options)
        # The YAML's adapters, loaded on every engine before the model is ready (vLLM's
        # own start-up fails where one does not load; here the model serves without it).
        try:
            await frontend.models.init_static_loras()
        finally:
            self._frontend = frontend

    # ---- LoRA adapters ------------------------------------------------------------------

    def is_adapter(self, name: str) -> bool:
        frontend = self._frontend
        return frontend is not None and name in frontend.models.lora_requests

    def adapter_cards(self) -> list[ModelCard]:
        frontend = self._frontend
        if frontend is None:
            return []
        return [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=self.name,
                owned_by="splitserve",
                max_model_len=self._prompts.max_model_len,
            )
            for lora in frontend.models.lora_requests.values()
        ]

    async def load_adapter(self, adapter: LoraAdapter) -> None:
        """Load ``adapter`` on every engine of the model, or on none: an engine that
        fails undoes the others, so that no engine is asked for what only some hold."""
        replicas = list(self.pool)
        results = await asyncio.gather(
            *(replica.link.add_lora(adapter) for replica in replicas), return_exceptions=True
        )
        outcomes = list(zip(replicas, results, strict=True))
        failed = [(r, e) for r, e in outcomes if isinstance(e, BaseException)]
        if failed:
            loaded = [r for r, e in outcomes if e is None]
            await _remove_adapter(loaded, adapter)
            where = ", ".join(f"{replica.name}: {error}" for replica, error in failed)
            raise RuntimeError(f"LoRA adapter {adapter.name!r} did not load ({where})")
        for replica in replicas:
            replica.adapters.add(adapter.name)
        self._adapters[adapter.int_id] = adapter

    async def unload_adapter(self, int_id: int) -> None:
        adapter = self._adapters.pop(int_id, None)
        if adapter is not None:
            await _remove_adapter([r for r in self.pool if adapter.name in r.adapters], adapter)

    async def update_adapters(self, route: str, body: Any) -> Response:
        """``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` as vllm serve answers
        them; unloading also frees the adapter on the engines, which vLLM's layer does not."""
        frontend = self._frontend
        if frontend is None:
            return self.starting().response()
        models = frontend.models
        if route == "/v1/load_lora_adapter":
            load = parse_request(LoadLoRAAdapterRequest, body, "ignore")
            answer = await models.load_lora_adapter(load, base_model_name=self.name)
        else:
            unload = parse_request(UnloadLoRAAdapterRequest, body, "ignore")
            loaded = models.lora_requests.get(unload.lora_name)
            answer = await models.unload_lora_adapter(unload)
            if loaded is not None and not isinstance(answer, ErrorResponse):
                await self.unload_adapter(loaded.lora_int_id)
        if isinstance(answer, ErrorResponse):
            return JSONResponse(answer.model_dump(), status_code=answer.error.code)
        return Response(answer, media_type="text/plain")

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
        self._observer.choices(dispatch.plan)
        streamed = request.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        relay = self._relay.chunks(dispatch, first, call, streamed)
        return relay, dispatch.response_headers()

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
            dispatch = self._dispatcher.start(plan, on_accepted=self._observer.queue_timer(arrival))
            self._observer.track(dispatch.replicas, +1)
            try:
                chunk = await anext(dispatch.stream, None)
                if chunk is None:
                    raise EngineFailed("the engine ended the request without output")
                return dispatch, (chunk, time.perf_counter())
            except BaseException as error:
                await self._relay.release(dispatch)
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

    def _admit_early(self, priority: Priority) -> None:
        if not self.readiness.is_ready:
            return  # nothing measured yet; the request waits for readiness below
        dispatcher = self._dispatcher
        refusal = self._admission.check(
            priority, dispatcher.queued_requests, lambda: dispatcher.earliest_ttft_s(priority)
        )
        if refusal is not None:
            self._refuse(refusal, priority)

    def _admit(self, plan: Plan) -> None:
        estimate = plan.ttft_estimate_s()
        if estimate is not None:
            self.metrics.ttft_estimate.labels(plan.prefill_replica.name).set(estimate)
        refusal = self._admission.check(
            plan.priority, self._dispatcher.queued_requests, lambda: estimate
        )
        if refusal is not None:
            self._refuse(refusal, plan.priority)

    def _refuse(self, refusal: Refusal, priority: Priority) -> NoReturn:
        self.metrics.rejections.labels(refusal.reason, priority).inc()
        raise Rejection(refusal)

    def starting(self) -> OpenAIError:
        waiting = ", ".join(self.readiness.starting()) or "the router"
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

    # ---- the model as the ingress reports it ----------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        """The model's card, then one per LoRA adapter it serves (as vllm serve lists)."""
        base = ModelCard(
            id=self.name, owned_by="splitserve", max_model_len=self._prompts.max_model_len
        )
        return [base, *self.adapter_cards()]

    async def replica_health(self) -> dict[str, str]:
        replicas = list(self.pool)
        states = await asyncio.gather(*(self._replica_health(r) for r in replicas))
        return {r.name: state for r, state in zip(replicas, states, strict=True)}

    async def check_health(self) -> None:
        # An engine in this process that dies is restarted here (LocalEngineLink) while
        # the others serve; only one that will not start again takes its router, and so
        # every engine, with it.
        for link in self.local_engines:
            with contextlib.suppress(EngineFailed):
                await link.check_health()  # a dead engine starts its own replacement
            if link.gave_up:
                raise RuntimeError(f"an engine of {self.name} could not be restarted")

    def close(self) -> None:
        """Stopping, not dying: no engine is restarted and no stream reconnects from here."""
        self._runtime.close()

    async def _adopt_engines_context(self) -> None:
        """Take the context length the engines derived (vLLM's rules: the model's own,
        capped by max_model_len), so the router refuses what they would refuse."""
        stats = await asyncio.gather(*(replica.link.stats() for replica in self.pool))
        reported = [s.max_model_len for s in stats if s.max_model_len]
        if reported and min(reported) != self._prompts.max_model_len:
            logger.info("the engines' context is %d tokens", min(reported))
            self._prompts.max_model_len = min(reported)

    async def _replica_health(self, replica: PooledEngine) -> str:
        if not replica.link.ready:
            return "starting"
        timeout = self._config.router.health_check_timeout_s
        try:
            await asyncio.wait_for(replica.link.check_health(), timeout)
        except Exception as error:
            return f"unhealthy: {type(error).__name__}"
        return "ok"
