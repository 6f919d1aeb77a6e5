"""The router's own class in this process, its engines synthetic ones beside it: the
whole request path (auth, limits, validation, tokenization, dispatch, responses)
without Ray or vLLM engines. Routes are called as methods with a Starlette Request,
which is what FastAPI hands them inside Serve.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.requests import Request

from deployments.app import engine_names, engine_spec
from deployments.config import parse_app_config
from engines.tiny_model import EMBEDDED_MODEL_NAME
from router.ingress import Router

# Serve's deployment wraps the class (serve.ingress); the class itself comes next.
ROUTER_CLASS: type = Router.func_or_class.__mro__[1]


def http_request(
    path: str, body: bytes = b"", headers: dict[str, str] | None = None, method: str = "POST"
) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    return Request(scope, receive)


def chat_body(content: str = "hi", **fields: Any) -> bytes:
    return json.dumps(
        {
            "model": EMBEDDED_MODEL_NAME,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            **fields,
        }
    ).encode()


@asynccontextmanager
async def in_process_router(**args: Any) -> AsyncIterator[Any]:
    """A started router for one synthetic engine; ``args``: YAML args beside the
    strategy and pools (``router``, ``auth``, ...)."""
    config = parse_app_config(
        {"strategy": "single", "pools": [{}], "engine": {"backend": "synthetic"}, **args}
    )
    names = engine_names(config)
    specs = {name: engine_spec(config, name, pool, index) for name, pool, index in names}
    roles = {name: pool.role for name, pool, _ in names}
    router = object.__new__(ROUTER_CLASS)
    await ROUTER_CLASS.__init__(router, config.ingress_settings(), roles, {}, specs)
    try:
        yield router
    finally:
        router.__del__()
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
