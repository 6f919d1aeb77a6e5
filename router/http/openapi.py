"""The router's OpenAPI description (``GET /openapi.json``), request bodies included.

The generation routes read their body raw, so that malformed JSON is answered in
OpenAI's error format rather than FastAPI's; FastAPI therefore knows nothing of the
body. This adds vLLM's own request models as the bodies' schemas, so clients and
property-based testers (tests/router/http/test_hostile_input.py) see what the router accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

COMPONENTS = "#/components/schemas/{model}"


def describe_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """``bodies``: the JSON body model of each POST route, by path."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_bodies(app, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _with_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for path, model in bodies.items():
        schema = model.model_json_schema(ref_template=COMPONENTS)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        document["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": COMPONENTS.format(model=model.__name__)}}
            },
        }
    return document
