"""One model's LoRA adapters: loaded on every engine of the model before they are
listed, freed on them when unloaded, and the adapter routes (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``) as ``vllm serve`` answers them.

vLLM's serving layer keeps the list of adapters a model serves (``OpenAIServingModels``)
and calls ``add_lora`` / ``remove_lora`` of its engine client, which is the router's
(router/http/vllm_frontend.py) and calls ``load`` / ``unload`` here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi.responses import JSONResponse, Response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelCard
from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

from engines.protocol import LoraAdapter
from router.http.requests import parse_request
from router.pool.engine_pool import EnginePool
from router.pool.pooled_engine import PooledEngine

logger = logging.getLogger("splitserve.router")
LOAD_ROUTE, UNLOAD_ROUTE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class ModelAdapters:
    def __init__(self, model: str, pool: EnginePool) -> None:
        self._model = model
        self._pool = pool
        # Adapters loaded on the engines, by vLLM's id for them.
        self._loaded: dict[int, LoraAdapter] = {}
        # vLLM's list of the model's adapters (OpenAIServingModels), once its serving
        # layer is built.
        self.served: Any = None

    def is_adapter(self, name: str) -> bool:
        return self.served is not None and name in self.served.lora_requests

    def cards(self, max_model_len: int) -> list[ModelCard]:
        if self.served is None:
            return []
        return [
            ModelCard(
                id=lora.lora_name,
                root=lora.lora_path,
                parent=self._model,
                owned_by="splitserve",
                max_model_len=max_model_len,
            )
            for lora in self.served.lora_requests.values()
        ]

    async def load(self, adapter: LoraAdapter) -> None:
        """Load ``adapter`` on every engine of the model, or on none: an engine that
        fails undoes the others, so that no engine is asked for what only some hold."""
        engines = list(self._pool)
        results = await asyncio.gather(
            *(engine.link.add_lora(adapter) for engine in engines), return_exceptions=True
        )
        outcomes = list(zip(engines, results, strict=True))
        failed = [(e, r) for e, r in outcomes if isinstance(r, BaseException)]
        if failed:
            await _remove([e for e, r in outcomes if r is None], adapter)
            where = ", ".join(f"{engine.name}: {error}" for engine, error in failed)
            raise RuntimeError(f"LoRA adapter {adapter.name!r} did not load ({where})")
        for engine in engines:
            engine.adapters.add(adapter.name)
        self._loaded[adapter.int_id] = adapter

    async def unload(self, int_id: int) -> None:
        adapter = self._loaded.pop(int_id, None)
        if adapter is not None:
            await _remove([e for e in self._pool if adapter.name in e.adapters], adapter)

    async def update(self, route: str, body: Any) -> Response:
        """``/v1/load_lora_adapter`` or ``/v1/unload_lora_adapter`` as vllm serve answers
        them; unloading also frees the adapter on the engines, which vLLM's layer does not.
        ``served`` is set: the router is ready."""
        served = self.served
        if route == LOAD_ROUTE:
            load = parse_request(LoadLoRAAdapterRequest, body, "ignore")
            answer = await served.load_lora_adapter(load, base_model_name=self._model)
        else:
            unload = parse_request(UnloadLoRAAdapterRequest, body, "ignore")
            loaded = served.lora_requests.get(unload.lora_name)
            answer = await served.unload_lora_adapter(unload)
            if loaded is not None and not isinstance(answer, ErrorResponse):
                await self.unload(loaded.lora_int_id)
        if isinstance(answer, ErrorResponse):
            return JSONResponse(answer.model_dump(), status_code=answer.error.code)
        return Response(answer, media_type="text/plain")


async def _remove(engines: list[PooledEngine], adapter: LoraAdapter) -> None:
    """Free ``adapter`` on these engines; one that cannot is gone or restarting, and holds
    nothing then."""
    for engine in engines:
        engine.adapters.discard(adapter.name)
    results = await asyncio.gather(
        *(engine.link.remove_lora(adapter) for engine in engines), return_exceptions=True
    )
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, Exception):
            logger.warning("%s did not free adapter %s: %s", engine.name, adapter.name, result)
