"""One model the router serves: its engines, its policies, and a request's way through
them, from a parsed body to the response.

The ingress (router/http/ingress.py) authenticates, reads the body and finds the model
it names; everything after that is this model's own: its pools, split, QoS, tokenizer
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vllm.sampling_params import RequestOutputKind
from vllm.utils.gc_utils import freeze_gc_heap

from engines.backends import ENGINE_BACKENDS
from engines.contract import EngineFailed, EngineLink, EngineUnavailable
from engines.model_source import resolve_model
from engines.protocol import GenerateChunk, GenerateRequest, LoraAdapter
from engines.transport import SocketEngineLink
from kv_transfer import KVRouterSide, make_kv_backend
from router.dispatch import Dispatch, Dispatcher, Plan
from router.http.auth import QueueSlot
from router.http.errors import OpenAIError
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
from router.observation.metrics import ModelMetrics
from router.observation.traffic_drift import TrafficDrift
from router.observation.traffic_record import TrafficRecorder
from router.pd_flow import PREFILL_FALLBACK_REASONS
from router.policies.prefill_gate import PrefillGate
from router.policies.prefill_policy import PrefillDecision
from router.policies.qos import ENGINE_PRIORITY, AdmissionControl, Rejection, take_priority
from router.pool.calibration import calibrate_ttft
from router.pool.engine_client import EngineClient, LocalEngineLink
from router.pool.engine_pool import EnginePool
from router.pool.engine_state import EngineStatePoller
from router.pool.replica_state import ReplicaState
from router.pool.watcher import PoolWatcher
from router.settings import ModelBinding, Priority

logger = logging.getLogger("splitserve.router")


async def _after(
    first: tuple[GenerateChunk, float], stream: AsyncIterator[GenerateChunk]
) -> AsyncIterator[tuple[GenerateChunk, float]]:
    """The chunk already read, then the rest of the stream, each with when it came."""
    yield first
    async for chunk in stream:
        yield chunk, time.perf_counter()


async def _remove_adapter(replicas: list[EngineClient], adapter: LoraAdapter) -> None:
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
        """``binding.engines``: Serve handles by replica name; ``binding.local_engines``:
        the specs of engines this process hosts itself; ``binding.pool_handles``: the
        Serve handles of scaled pools, by deployment name (see deployments/app.py)."""
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
        qos = settings.qos
        # Started side by side; each spawn alone (its processes inherit its environment).
        restarts = settings.router.engine_restart_attempts
        host_class = ENGINE_BACKENDS.get(settings.engine_backend)
        local_engines = binding.local_engines
        self.local_engines = [
            LocalEngineLink(name, functools.partial(host_class, spec), restarts)
            for name, spec in local_engines.items()
        ]
        links: dict[str, EngineLink] = {
            name: SocketEngineLink(handle, engine=name) for name, handle in binding.engines.items()
        }
        links.update(zip(local_engines, self.local_engines, strict=True))
        roles = binding.roles
        self.pool = EnginePool(
            [self._pool_member(name, roles[name], link) for name, link in links.items()]
        )
        self.pool.start()
        handles = binding.pool_handles
        self._pool_watcher = PoolWatcher(
            self.pool,
            [(scaled, handles[scaled.deployment]) for scaled in settings.scaled_pools],
            self._pool_member,
        )
        self._pool_watcher.start()
        # Engines load in the background; until all are up the router says so (503), and
        # before it admits anything it times a prefill on each (the TTFT estimate's seed).
        calibration = functools.partial(
            calibrate_ttft, self.pool, qos.calibration_prompt_tokens, vocab_size
        )

        # vLLM's serving layer, for what the router's own path does not render: built
        # once the engines are up (start_frontend).
        self._frontend: VllmFrontend | None = None

        async def engines_ready() -> None:
            await self._adopt_engines_context()
            await calibration()
            await start_order.after_every_engine(self._start_frontend)

        self.readiness = Readiness(
            self.pool, on_engines_ready=engines_ready, members_known=self._pool_watcher.populated
        )
        self._kv: KVRouterSide | None = None
        if settings.kv_transfer is not None:
            self._kv = make_kv_backend(settings.kv_transfer).router_side()
        self._admission = AdmissionControl(settings.qos)
        record = settings.router.traffic_record
        self._recorder = (
            TrafficRecorder(record, settings.router.traffic_record_block_tokens) if record else None
        )
        self.metrics = metrics
        profile = settings.router.traffic_profile
        self._drift = (
            TrafficDrift(profile, metrics.traffic_drift, metrics.traffic_drifted)
            if profile
            else None
        )
        self._mode = settings.shape
        # Observed once per relayed token: the labelled child is looked up once.
        self._itl = metrics.itl.labels(self._mode)
        self.engine_state = EngineStatePoller(
            self.pool,
            metrics,
            settings.router.stats_interval_s,
            settings.router.unhealthy_after_failed_polls,
            kv=self._kv,
            ema_weight=qos.ema_weight,
            kv_interval_s=settings.router.kv_metrics_interval_s,
        )
        self._dispatcher = Dispatcher(
            settings, self.pool, self._kv, self.engine_state.transfer_cost.estimate_s
        )
        self.engine_state.start()

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
                subscriber="",  # set by the EngineClient that submits it
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
        self._count_choices(dispatch.plan)
        headers.update(dispatch.response_headers())
        events = self._events(dispatch, first, prepared, writer, arrival)
        if prepared.stream:
            self.metrics.requests.labels(route, "200", priority).inc()
            # Closed by the response however it ends, even if it never started streaming.
            return EventStreamResponse(
                events, headers, on_close=functools.partial(self._release, dispatch)
            )
        return await self._collect(events, writer, route, headers, priority)

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
                    self._observe_token_timing(call.arrival, last_token_at, now, dispatch.decision)
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
        self.metrics.e2e.labels(self._mode).observe(time.perf_counter() - arrival)
        self.metrics.tokens.labels("prompt").inc(len(prompt_token_ids))
        self.metrics.tokens.labels("generation").inc(generated)
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
        decision = dispatch.decision
        self.metrics.prefill_decisions.labels(decision.where, decision.reason).inc()

    def _admit_early(self, priority: Priority) -> None:
        if not self.readiness.is_ready:
            return  # nothing measured yet; the request waits for readiness below
        dispatcher = self._dispatcher
        try:
            self._admission.check(
                priority, dispatcher.queued_requests, lambda: dispatcher.earliest_ttft_s(priority)
            )
        except Rejection as rejection:
            self.metrics.rejections.labels(rejection.reason, priority).inc()
            raise

    def _admit(self, plan: Plan) -> None:
        estimate = plan.ttft_estimate_s()
        if estimate is not None:
            self.metrics.ttft_estimate.labels(plan.prefill_replica.name).set(estimate)
        try:
            self._admission.check(plan.priority, self._dispatcher.queued_requests, lambda: estimate)
        except Rejection as rejection:
            self.metrics.rejections.labels(rejection.reason, plan.priority).inc()
            raise

    def _queue_timer(self, arrival: float) -> Callable[[], None]:
        def accepted() -> None:
            self.metrics.queue.labels(self._mode).observe(time.perf_counter() - arrival)

        return accepted

    def _count_choices(self, plan: Plan) -> None:
        for choice, prefill in ((plan.main, False), (plan.prefill, True)):
            if choice is not None:
                replica = choice.replica
                policy = self._dispatcher.policy_of(choice, prefill)
                self.metrics.replica_choices.labels(
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
            self.metrics.requests.labels(route, str(int(error.status)), priority).inc()
            return error.response(headers)
        assert transcript is not None
        self.metrics.requests.labels(route, "200", priority).inc()
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
                    self._observe_token_timing(arrival, last_token_at, now, dispatch.decision)
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

    def _observe_prefix_estimate(self, dispatch: Dispatch, chunk: GenerateChunk) -> None:
        """Set the router's prefix-cache estimate beside what vLLM found, per replica."""
        if dispatch.decision.reason in PREFILL_FALLBACK_REASONS:
            return  # another replica computed the prompt than the one estimated for
        name = dispatch.prefill_replica.name
        tokens = self.metrics.prefix_cache_tokens
        tokens.labels(name, "estimated").inc(dispatch.expected_cached_tokens)
        tokens.labels(name, "reported").inc(chunk.num_cached_tokens)
        for signal, estimate in dispatch.plan.cached_by_signal.items():
            tokens.labels(name, signal).inc(estimate)
            error = abs(estimate - chunk.num_cached_tokens)
            self.metrics.prefix_estimate_error.labels(signal).observe(error)

    def _observe_token_timing(
        self, arrival: float, last_token_at: float | None, now: float, decision: PrefillDecision
    ) -> None:
        if last_token_at is None:
            self.metrics.ttft.labels(self._mode, decision.where).observe(now - arrival)
        else:
            self._itl.observe(now - last_token_at)

    def _track(self, replicas: list[EngineClient], delta: int) -> None:
        for replica in replicas:
            replica.in_flight += delta
            labels = (replica.name, replica.role)
            self.metrics.replica_in_flight.labels(*labels).set(replica.in_flight)
            if delta > 0:
                self.metrics.replica_requests.labels(*labels).inc()

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
        self._pool_watcher.stop()
        self.pool.close()
        if self._kv is not None:
            self._kv.shutdown()  # what the KV backend holds for this application goes with it

    async def _adopt_engines_context(self) -> None:
        """Take the context length the engines derived (vLLM's rules: the model's own,
        capped by max_model_len), so the router refuses what they would refuse."""
        stats = await asyncio.gather(*(replica.link.stats() for replica in self.pool))
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
