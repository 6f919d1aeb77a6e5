"""The OpenAI-compatible ingress deployment (FastAPI inside Ray Serve).

One request: authenticate, read the body, find the model it names (a 404 naming the
served ones otherwise), and hand it to that model (router/http/served_model.py), which
validates and tokenizes it, chooses its engines, and streams their token deltas back as
SSE or one JSON body. Every request the router answers lives one ``RequestLife``
(router/lifecycle.py) from here on, and is counted when it ends; a client that goes away
ends it, which aborts the request inside vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.engine.protocol import ModelList
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

from engines.model_source import served_name_of
from kv_transfer import KVTransferCollector
from kv_transfer.metrics import TransferTotals, sum_totals
from router.http.adapters import LOAD_ROUTE, UNLOAD_ROUTE
from router.http.auth import ApiKeys, check_exposure
from router.http.errors import OpenAIError, routing_error_response
from router.http.life_response import LifeResponse
from router.http.openapi import describe_request_bodies
from router.http.served_model import ServedModel, StartOrder
from router.lifecycle import RequestLife
from router.observation.metrics import RouterMetrics
from router.pool.stats_poller import EngineStatsPoller
from router.settings import ModelBinding
from splitserve.metric_catalogue import REQUEST_ID_HEADER

logger = logging.getLogger("splitserve.router")

app = FastAPI(title="splitserve router")
app.add_exception_handler(StarletteHTTPException, routing_error_response)
describe_request_bodies(
    app,
    {
        "/v1/completions": CompletionRequest,
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/messages": AnthropicMessagesRequest,
        "/v1/messages/count_tokens": AnthropicCountTokensRequest,
    },
)


def _kv_totals_of(states: list[EngineStatsPoller]) -> TransferTotals | None:
    """The engines' summed transfer statistics, as the models' pollers last read them.
    (Above the class: Serve's ingress decorator pickles it by value, with the globals it
    names then.)"""
    read = [state.kv_transfer_totals for state in states if state.kv_transfer_totals]
    return sum_totals([totals.data for totals in read]) if read else None


def _kv_ledger_of(state: EngineStatsPoller) -> dict[str, Any] | None:
    """The KV backend's ledger, as the router's poller last read it."""
    return state.kv_ledger


@serve.ingress(app)
class Router:
    async def __init__(self, models: list[ModelBinding]) -> None:  # type: ignore[misc]  # Serve awaits it
        """``models``: each served model's settings and engines (deployments/app.py)."""
        first = models[0].settings
        self._auth = ApiKeys.from_settings(first.auth)
        check_exposure(self._auth, first.http_host, first.auth.allow_open, logger)
        self._metrics = RouterMetrics()
        start_order = StartOrder(len(models))
        self._models: dict[str, ServedModel] = {}
        for binding in models:
            name = served_name_of(binding.settings.model)
            self._models[name] = ServedModel(binding, self._metrics.for_model(name), start_order)
        # Where a body that names no model goes, and whose limits read every body.
        self._first = next(iter(self._models.values()))
        self._register_kv_collectors()

    def _register_kv_collectors(self) -> None:
        """One collector per KV directory (models that share one would render its ledger
        twice), over the engines of every model that uses it."""
        by_namespace: dict[str, list[EngineStatsPoller]] = {}
        for served in self._models.values():
            if served.kv_namespace is not None:
                by_namespace.setdefault(served.kv_namespace, []).append(served.stats_poller)
        for states in by_namespace.values():
            self._metrics.registry.register(
                KVTransferCollector(
                    functools.partial(_kv_totals_of, states),
                    functools.partial(_kv_ledger_of, states[0]),
                )
            )

    # ---- routes -------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        return self._handle(raw, CompletionRequest, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        return self._handle(raw, ChatCompletionRequest, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(self, raw: Request) -> Response:
        return self._handle(raw, ResponsesRequest, "/v1/responses")

    @app.post("/v1/messages")
    async def messages(self, raw: Request) -> Response:
        return self._handle(raw, AnthropicMessagesRequest, "/v1/messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(self, raw: Request) -> Response:
        return self._handle(raw, AnthropicCountTokensRequest, "/v1/messages/count_tokens")

    @app.post("/tokenize")
    async def tokenize(self, raw: Request) -> Response:
        return self._handle(raw, TokenizeRequest, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(self, raw: Request) -> Response:
        return self._handle(raw, DetokenizeRequest, "/detokenize")

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, raw: Request) -> Response:
        return self._life(raw, "/v1/models", functools.partial(self._model_card, raw, model_id))

    @app.get("/v1/models")
    async def models(self, raw: Request) -> Response:
        return self._life(raw, "/v1/models", functools.partial(self._model_list, raw))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, raw: Request) -> Response:
        return self._life(raw, LOAD_ROUTE, functools.partial(self._update_adapters, raw))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, raw: Request) -> Response:
        return self._life(raw, UNLOAD_ROUTE, functools.partial(self._update_adapters, raw))

    @app.get("/health")
    async def health(self, raw: Request) -> Response:
        if refused := self._auth.refusal(raw.headers, "/health"):
            return refused.response()
        served = list(self._models.values())
        reports = await asyncio.gather(*(model.engine_health() for model in served))
        states = {name: state for report in reports for name, state in report.items()}
        ready = all(model.readiness.is_ready for model in served)
        healthy = ready and all(state == "ok" for state in states.values())
        status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
        overall = "ok" if healthy else "degraded" if ready else "starting"
        body: dict[str, Any] = {
            "status": overall,
            # Which router replica answered: an application may run several.
            "router": serve.get_replica_context().replica_id.unique_id,
            "replicas": states,
        }
        if len(served) > 1:
            body["models"] = {
                model.name: sorted(report) for model, report in zip(served, reports, strict=True)
            }
        return JSONResponse(body, status_code=int(status))

    @app.get("/metrics")
    async def metrics(self, raw: Request) -> Response:
        if refused := self._auth.refusal(raw.headers, "/metrics"):
            return refused.response()
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- one request, up to the model it names --------------------------------------------

    def _life(
        self,
        raw: Request,
        route: str,
        answer: Callable[[RequestLife], Awaitable[Response]],
        priority: str = "none",
    ) -> LifeResponse:
        """The response of a request that lives from here: ``answer`` makes it.
        ``priority``: what it is counted at until its model reads its own."""
        request_id = raw.headers.get(REQUEST_ID_HEADER) or f"req-{uuid.uuid4().hex}"
        life = RequestLife(route, request_id, self._count)
        life.priority = priority
        return LifeResponse(life, functools.partial(answer, life))

    def _handle(self, raw: Request, model_cls: Any, route: str) -> Response:
        answer = functools.partial(self._answer, raw, model_cls)
        return self._life(raw, route, answer, self._first.default_priority)

    async def _answer(self, raw: Request, model_cls: Any, life: RequestLife) -> Response:
        client = self._auth.authenticate(raw.headers, life.route)  # 401/403 before the body
        raw_body, body = await self._read_body(raw)
        served = self._model_of(body)
        life.model = served.name
        life.priority = asked = served.priority_of(body, raw.headers)
        priority, slot = self._auth.admit(client, asked, served.metrics)
        served.lifecycle.enter(life, priority, slot, client.flow)
        if model_cls in (CompletionRequest, ChatCompletionRequest):
            return await served.generate(life, raw, body, len(raw_body), model_cls)
        return await served.serve_by_vllm(life, raw, body, model_cls)

    async def _model_list(self, raw: Request, life: RequestLife) -> Response:
        if refused := self._auth.refusal(raw.headers, "/v1/models"):
            raise refused
        starting = [served for served in self._models.values() if not served.readiness.is_ready]
        if starting:
            # Clients take a model list as readiness; vLLM's server does not listen yet.
            raise starting[0].starting_error()
        cards = [card for served in self._models.values() for card in served.model_cards()]
        return JSONResponse(ModelList(data=cards).model_dump())

    async def _model_card(self, raw: Request, model_id: str, life: RequestLife) -> Response:
        await self._model_list(raw, life)  # the same keys and readiness
        cards = {card.id: card for served in self._models.values() for card in served.model_cards()}
        if model_id not in cards:
            raise self._unknown_model(model_id)
        return JSONResponse(cards[model_id].model_dump())

    async def _read_body(self, raw: Request) -> tuple[bytes, Any]:
        """The raw body and its JSON, read before the body names its model: by the router
        process's own limits, which every model shares (deployments/config.py
        ROUTER_PROCESS_FIELDS)."""
        reader = self._first.requests
        raw_body = await reader.receive(raw.headers, raw.stream())
        return raw_body, await reader.decode_off_loop(raw_body)

    def _model_of(self, body: Any) -> ServedModel:
        """The served model a body names, or whose LoRA adapter it names; without a
        name, the first (as vllm serve)."""
        name = body.get("model") if isinstance(body, dict) else None
        if name is None:
            return self._first
        served = self._models.get(name) if isinstance(name, str) else None
        if served is None and isinstance(name, str):
            served = next((m for m in self._models.values() if m.is_adapter(name)), None)
        if served is None:
            raise self._unknown_model(name)
        return served

    def _unknown_model(self, name: Any) -> OpenAIError:
        names = [card.id for served in self._models.values() for card in served.model_cards()]
        return OpenAIError(
            f"The model '{name}' does not exist; this server serves"
            f" {', '.join(repr(n) for n in names)}.",
            HTTPStatus.NOT_FOUND,
            "model",
        )

    # ---- LoRA adapters at run time ---------------------------------------------------------

    async def _update_adapters(self, raw: Request, life: RequestLife) -> Response:
        """vllm serve's adapter routes, behind the API keys, for models whose YAML allows
        them (model.runtime_lora_updates). ``model`` in the body names the base model
        where several allow them."""
        self._auth.authenticate(raw.headers, life.route)
        _, body = await self._read_body(raw)
        served = self._updatable_model(body)
        life.model = served.name
        return await served.update_adapters(life.route, body)

    def _updatable_model(self, body: Any) -> ServedModel:
        updatable = [m for m in self._models.values() if m.runtime_lora_updates]
        if not updatable:
            raise OpenAIError(
                "loading LoRA adapters at run time is off: set model.runtime_lora_updates",
                HTTPStatus.NOT_FOUND,
            )
        name = body.get("model") if isinstance(body, dict) else None
        adapter = body.get("lora_name") if isinstance(body, dict) else None
        if name is None and isinstance(adapter, str):
            # Unloading names only the adapter: the model that serves it.
            name = next((m.name for m in updatable if m.is_adapter(adapter)), None)
        if name is None:
            if len(updatable) > 1:
                names = ", ".join(repr(m.name) for m in updatable)
                raise OpenAIError(
                    f"name the base model in 'model': one of {names}",
                    HTTPStatus.BAD_REQUEST,
                    "model",
                )
            return updatable[0]
        served = next((m for m in updatable if m.name == name), None)
        if served is None:
            names = ", ".join(repr(m.name) for m in updatable)
            raise OpenAIError(
                f"'{name}' takes no adapters at run time; these do: {names}",
                HTTPStatus.NOT_FOUND,
                "model",
            )
        return served

    def _count(self, life: RequestLife) -> None:
        """Each request once, when its life ends (RequestLife.release); by its key too,
        where its model's admission decided on it."""
        metrics = self._metrics
        status = str(life.status)
        metrics.requests.labels(life.model, life.route, status, life.priority).inc()
        if life.outcome is not None:
            labels = (life.model, life.flow.name, life.priority, life.outcome)
            metrics.key_requests.labels(*labels).inc()

    async def check_health(self) -> None:
        # Serve restarts this replica when this raises.
        for served in self._models.values():
            await served.check_health()

    def __del__(self) -> None:
        for served in getattr(self, "_models", {}).values():
            served.close()
