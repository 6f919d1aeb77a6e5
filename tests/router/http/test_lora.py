"""LoRA adapters through the router, in this process with synthetic engines: the
YAML's adapters listed and routed by name, loaded on every engine, and adapters loaded
and unloaded at run time (router/http/served_model.py, router/dispatch.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engines.protocol import GenerateRequest
from engines.synthetic import SyntheticEngineHost
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.support.in_process_router import (
    COMPLETIONS,
    PROMPT,
    http_client,
    in_process_router,
    only_model,
    openai_error,
    ready,
)

ADAPTERS = [{"name": "sql", "path": "embedded-lora:1"}, {"name": "py", "path": "embedded-lora:2"}]
MODEL = {"lora_adapters": ADAPTERS, "runtime_lora_updates": True}


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, GenerateRequest]]:
    """(engine, request) of every request a synthetic engine was given, in order."""
    seen: list[tuple[str, GenerateRequest]] = []
    submit = SyntheticEngineHost.submit

    async def recording(host: SyntheticEngineHost, request: GenerateRequest) -> None:
        seen.append((host._spec.name, request))
        await submit(host, request)

    monkeypatch.setattr(SyntheticEngineHost, "submit", recording)
    return seen


@asynccontextmanager
async def router_with_adapters(**args: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    async with in_process_router(model=MODEL, **args) as router, http_client(router) as client:
        await ready(client, timeout_s=120)  # vLLM's layer loads the adapters first
        yield router, client


def completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 3, **fields}


async def test_the_yamls_adapters_are_listed_loaded_and_served_by_name(
    submitted: list[tuple[str, GenerateRequest]],
) -> None:
    async with router_with_adapters(shape="dp", pools=[{"replicas": 2}]) as (router, client):
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(card["id"], card["parent"]) for card in listed] == [
            (EMBEDDED_MODEL_NAME, None),
            ("sql", EMBEDDED_MODEL_NAME),
            ("py", EMBEDDED_MODEL_NAME),
        ]
        assert all(r.adapters == {"sql", "py"} for r in only_model(router).pool)
        for stream in (False, True):
            answered = await client.post(COMPLETIONS, json=completion("sql", stream=stream))
            assert answered.status_code == 200, answered.text
        base = await client.post(COMPLETIONS, json=completion(EMBEDDED_MODEL_NAME))
        assert base.status_code == 200
    served = submitted[-3:]  # after each engine's calibration prefill
    assert [None if r.lora is None else r.lora.name for _, r in served] == ["sql", "sql", None]
    lora = served[0][1].lora
    assert lora is not None and lora.path == "embedded-lora:1" and lora.int_id >= 1


async def test_a_request_goes_to_an_engine_that_holds_its_adapter(
    submitted: list[tuple[str, GenerateRequest]],
) -> None:
    async with router_with_adapters(shape="dp", pools=[{"replicas": 2}]) as (router, client):
        engine_1 = only_model(router).pool.get("engine-1")
        engine_1.adapters.discard("sql")  # as if it had restarted since
        for _ in range(4):
            answered = await client.post(COMPLETIONS, json=completion("sql"))
            assert answered.headers["x-splitserve-replica"] == "engine-0"
        served = {
            (await client.post(COMPLETIONS, json=completion("py"))).headers["x-splitserve-replica"]
            for _ in range(4)
        }
        assert served == {"engine-0", "engine-1"}  # both hold py: round-robin as usual


async def test_adapters_load_and_unload_at_run_time() -> None:
    async with router_with_adapters() as (router, client):
        load = {"lora_name": "ops", "lora_path": "embedded-lora:3"}
        loaded = await client.post("/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert "ops" in [card["id"] for card in (await client.get("/v1/models")).json()["data"]]
        assert (await client.post(COMPLETIONS, json=completion("ops"))).status_code == 200
        again = await client.post("/v1/load_lora_adapter", json=load)
        assert again.status_code == 400  # vLLM's answer: already loaded
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ops"})
        assert unloaded.status_code == 200, unloaded.text
        assert all("ops" not in r.adapters for r in only_model(router).pool)
        gone = await client.post(COMPLETIONS, json=completion("ops"))
        message = openai_error(gone, 404, "NotFoundError", "model")
        assert "'ops' does not exist" in message and "'sql'" in message


async def test_run_time_loading_is_off_unless_the_yaml_allows_it() -> None:
    model = {"lora_adapters": ADAPTERS}
    async with in_process_router(model=model) as router, http_client(router) as client:
        await ready(client, timeout_s=120)
        load = {"lora_name": "ops", "lora_path": "embedded-lora:3"}
        refused = await client.post("/v1/load_lora_adapter", json=load)
        assert refused.status_code == 404
        assert "model.runtime_lora_updates" in refused.json()["error"]["message"]


async def test_run_time_loading_takes_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEAM_KEY", "sk-team-0123456789")
    auth = {"keys": [{"key_env": "TEAM_KEY", "routes": ["/v1/completions"]}]}
    async with router_with_adapters(auth=auth) as (_, client):
        load = {"lora_name": "ops", "lora_path": "embedded-lora:3"}
        assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 401
        headers = {"authorization": "Bearer sk-team-0123456789"}
        forbidden = await client.post("/v1/load_lora_adapter", json=load, headers=headers)
        assert forbidden.status_code == 403
