"""One model the router serves: its engines, its policies, and how a request it takes is
answered, by the router's own path or by vLLM's serving layer.

The ingress (router/http/ingress.py) authenticates, reads the body and finds the model
it names; from there the request lives through this model's ``Lifecycle``
(router/lifecycle.py) with its pools, prefill policy, QoS, tokenizer and vLLM serving
layer, so that two models in one application share nothing but the router's process,
its API keys and its metrics registry (with a ``model`` label). Its LoRA adapters are
router/http/adapters.py's, its readiness and health router/http/readiness.py's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ModelCard
from vllm.utils.gc_utils import freeze_gc_heap

from engines.model_source import resolve_model
from engines.protocol import GenerateRequest
from router.http.adapters import ModelAdapters
from router.http.errors import OpenAIError
from router.http.plain_answer import plain_answer
from router.http.readiness import check_local_engines
from router.http.requests import (
    OpenAIRequest,
    PromptBuilder,
    RequestValidator,
    ServedByVllm,
    parse_request,
    take_priority,
)
from router.http.responses import ResponseWriter
from router.http.vllm_frontend import (
    DispatchingEngineClient,
    FrontendOptions,
    VllmFrontend,
    frontend_config,
    in_daemon_thread,
)
from router.lifecycle import Lifecycle, RequestLife
from router.observation.metrics import ModelMetrics
from router.observation.requests import RequestMetrics
from router.policies.fair_share import FairShares
from router.pool.calibration import calibrate_ttft
from router.runtime import build_runtime
from router.settings import ModelBinding, Priority

logger = logging.getLogger("splitserve.router")


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
        self.pool, self.readiness = runtime.pool, runtime.readiness
        self.stats_poller = runtime.stats_poller
        self.adapters = ModelAdapters(self.name, runtime.pool)
        self.metrics = metrics
        recorded = RequestMetrics(
            metrics, settings.shape, runtime.dispatcher, runtime.recorder, runtime.drift
        )
        self.lifecycle = Lifecycle(
            self.name,
            settings.router,
            runtime.dispatcher,
            runtime.admission,
            runtime.readiness,
            recorded,
            fair_shares=FairShares(),
        )

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

    def is_adapter(self, name: str) -> bool:
        return self.adapters.is_adapter(name)

    # ---- a request's answer --------------------------------------------------------------

    async def generate(
        self, life: RequestLife, raw: Request, body: Any, body_bytes: int, model_cls: type[Any]
    ) -> Response:
        """A completion or chat request: the router's own path where it can render the
        answer, else vLLM's serving layer's."""
        life.admit_early()
        try:
            prepared = await self.requests.prepare_off_loop(model_cls, body, body_bytes)
        except ServedByVllm as routed:
            return await self._by_vllm(routed.request, raw, life)
        request = GenerateRequest(
            # vLLM needs ids unique among running requests; clients may reuse theirs.
            request_id=f"{life.request_id}-{uuid.uuid4().hex[:8]}",
            subscriber="",  # set by the PooledEngine that submits it
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=prepared.sampling_params,
        )
        await life.wait_ready()
        opened = await life.open(life.plan(request))
        chat = model_cls is ChatCompletionRequest
        writer = ResponseWriter(
            chat=chat,
            model=self.name,
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{life.request_id}",
            return_token_ids=prepared.return_token_ids,
        )
        return await plain_answer(life, opened, prepared, writer)

    async def serve_by_vllm(
        self, life: RequestLife, raw: Request, body: Any, model_cls: type[Any]
    ) -> Response:
        """A route only vLLM's layer serves (Responses, tokenize, detokenize): the same
        keys, limits and admission as the completion routes, then vLLM's answer."""
        life.admit_early()
        request = parse_request(model_cls, body, self._config.router.unknown_fields)
        return await self._by_vllm(request, raw, life)

    async def _by_vllm(self, request: OpenAIRequest, raw: Request, life: RequestLife) -> Response:
        await life.wait_ready()
        assert self._frontend is not None  # built before the router is ready
        return await self._frontend.serve(request, raw, life)

    async def update_adapters(self, route: str, body: Any) -> Response:
        if self._frontend is None:
            raise self.starting_error()
        return await self.adapters.update(route, body)

    def starting_error(self) -> OpenAIError:
        """The 503 of a model whose engines are not all up."""
        return self.readiness.starting_error(self._config.router.ready_wait_s)

    # ---- start-up -----------------------------------------------------------------------

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
        loader = self.adapters if self._config.model.lora_enabled else None
        client = DispatchingEngineClient(vllm_config, loader)
        options = FrontendOptions.of(
            self._config.model, self._config.router.trust_request_chat_template
        )
        frontend = await in_daemon_thread(VllmFrontend, client, options)
        self.adapters.served = frontend.models
        # The YAML's adapters, loaded on every engine before the model is ready (vLLM's
        # own start-up fails where one does not load; here the model serves without it).
        try:
            await frontend.models.init_static_loras()
        finally:
            self._frontend = frontend

    async def _adopt_engines_context(self) -> None:
        """Take the context length the engines derived (vLLM's rules: the model's own,
        capped by max_model_len), so the router refuses what they would refuse."""
        stats = await asyncio.gather(*(engine.link.stats() for engine in self.pool))
        reported = [s.max_model_len for s in stats if s.max_model_len]
        if reported and min(reported) != self._prompts.max_model_len:
            logger.info("the engines' context is %d tokens", min(reported))
            self._prompts.max_model_len = min(reported)

    # ---- the model as the ingress reports it ----------------------------------------------

    def model_cards(self) -> list[ModelCard]:
        """The model's card, then one per LoRA adapter it serves (as vllm serve lists)."""
        max_model_len = self._prompts.max_model_len
        base = ModelCard(id=self.name, owned_by="splitserve", max_model_len=max_model_len)
        return [base, *self.adapters.cards(max_model_len)]

    async def engine_health(self) -> dict[str, str]:
        return await self.readiness.engine_health(self._config.router.health_check_timeout_s)

    async def check_health(self) -> None:
        await check_local_engines(self._runtime.local_engines, self.name)

    def close(self) -> None:
        """Stopping, not dying: no engine is restarted and no stream reconnects from here."""
        self._runtime.close()
