"""API keys: 401 and 403 in OpenAI's format, priorities capped by key and counted, a
key's own queue cap, keys from the YAML and the environment, the open routes; against
router/http/auth.py and against the router's request path in this process (no Ray)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from deployments.config import ConfigError, parse_app_config
from engines.tiny_model import EMBEDDED_MODEL_NAME
from router.http import ingress
from router.http.auth import (
    KEY_QUEUE_FULL,
    KEYS_ENV,
    VLLM_KEY_ENV,
    ApiKeys,
    AuthSetupError,
    Client,
    QueueSlot,
    Unauthorized,
    check_exposure,
    is_loopback,
)
from router.http.errors import OpenAIError, Rejection
from router.observation.metrics import ModelMetrics, RouterMetrics
from router.policies.qos import Refusal
from router.settings import AuthConfig
from tests.support.in_process_router import answer, chat_body, http_request, in_process_router

CHAT = "/v1/chat/completions"
TEAM_KEY = "sk-team-a-0123456789"
PROBE_KEY = "sk-prometheus-0123456789"
# /metrics guarded, as a deployment that keeps its traffic to itself sets it.
AUTH = {
    "retry_after_s": 2,
    "open_paths": ["/health"],
    "keys": [
        {"key_env": "TEAM_A_KEY", "max_priority": "normal", "max_queued": 2},
        {"name": "prometheus", "key": PROBE_KEY, "routes": ["/metrics", "/health"]},
    ],
}
ENV = {"TEAM_A_KEY": TEAM_KEY}


def keys(auth: dict[str, Any] = AUTH, environ: dict[str, str] = ENV) -> ApiKeys:
    return ApiKeys.from_settings(AuthConfig.model_validate(auth), environ)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def sample(metrics: RouterMetrics | ModelMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# ---- router/http/auth.py ---------------------------------------------------------------------


def test_without_keys_every_route_is_open() -> None:
    open_keys = keys({}, {})
    assert not open_keys.enabled
    assert open_keys.authenticate({}, CHAT).max_priority == "high"


@pytest.mark.parametrize(
    "headers",
    [{}, {"authorization": ""}, bearer(""), {"authorization": f"Basic {TEAM_KEY}"}],
)
def test_a_missing_key_is_a_401(headers: dict[str, str]) -> None:
    with pytest.raises(Unauthorized) as raised:
        keys().authenticate(headers, CHAT)
    response = raised.value.response()
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert isinstance(response.body, bytes)
    error = json.loads(response.body)["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401
    assert "Authorization: Bearer" in error["message"]


@pytest.mark.parametrize("key", ["sk-wrong", TEAM_KEY + "x", TEAM_KEY[:-1], TEAM_KEY.upper()])
def test_a_wrong_key_is_a_401_that_does_not_quote_it(key: str) -> None:
    with pytest.raises(Unauthorized) as raised:
        keys().authenticate(bearer(key), CHAT)
    assert raised.value.message == "invalid API key"


def test_a_key_finds_its_client_by_name_whatever_the_scheme_case() -> None:
    client = keys().authenticate({"authorization": f"bearer  {TEAM_KEY} "}, CHAT)
    assert client == Client("TEAM_A_KEY", "normal", 2, None)


def test_a_key_in_x_api_key_is_taken_where_no_bearer_is_sent() -> None:
    # Anthropic's SDK and the agents built on it send their key so.
    assert keys().authenticate({"x-api-key": f" {TEAM_KEY} "}, CHAT).name == "TEAM_A_KEY"
    with pytest.raises(Unauthorized):
        keys().authenticate({"x-api-key": "sk-wrong"}, CHAT)
    # Both sent: the bearer token is the key, as vllm serve reads it.
    both = {**bearer(PROBE_KEY), "x-api-key": TEAM_KEY}
    assert keys().authenticate(both, "/metrics").name == "prometheus"


def test_a_401_in_anthropics_format_keeps_its_challenge() -> None:
    with pytest.raises(Unauthorized) as raised:
        keys().authenticate({}, "/v1/messages")
    response = raised.value.response(anthropic=True)
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert isinstance(response.body, bytes)
    body = json.loads(response.body)
    assert body["type"] == "error" and body["error"]["type"] == "AuthenticationError"
    assert set(body["error"]) == {"type", "message"}


def test_a_key_not_allowed_a_route_is_a_403() -> None:
    with pytest.raises(OpenAIError) as raised:
        keys().authenticate(bearer(PROBE_KEY), CHAT)
    assert raised.value.status == 403
    error = raised.value.body()["error"]
    assert isinstance(error, dict) and error["type"] == "PermissionDeniedError"
    assert "'prometheus' may not call /v1/chat/completions" in raised.value.message
    assert keys().authenticate(bearer(PROBE_KEY), "/metrics").name == "prometheus"


def test_open_paths_answer_without_a_key_and_only_they() -> None:
    configured = keys()
    assert configured.refusal({}, "/health") is None  # open by default
    for route in ("/metrics", "/v1/models", CHAT):
        refusal = configured.refusal({}, route)
        assert refusal is not None and refusal.status == 401
    opened = keys({**AUTH, "open_paths": ["/health", "/metrics"]})
    assert opened.refusal({}, "/metrics") is None


def test_keys_from_the_environment_too() -> None:
    environ = {**ENV, KEYS_ENV: "sk-one, sk-two,", VLLM_KEY_ENV: "sk-vllm"}
    found = keys(AUTH, environ)
    names = [found.authenticate(bearer(key), CHAT).name for key in ("sk-one", "sk-two", "sk-vllm")]
    assert names == [f"{KEYS_ENV}[0]", f"{KEYS_ENV}[1]", VLLM_KEY_ENV]
    assert keys({}, {VLLM_KEY_ENV: "sk-vllm"}).enabled  # as `vllm serve` with VLLM_API_KEY


@pytest.mark.parametrize(
    ("auth", "environ", "message"),
    [
        (AUTH, {}, "auth.keys[0].key_env: the environment variable TEAM_A_KEY is not set"),
        (AUTH, {"TEAM_A_KEY": "has space"}, "auth.keys[0].key_env: a key must be visible ASCII"),
        (AUTH, {**ENV, VLLM_KEY_ENV: TEAM_KEY}, "VLLM_API_KEY holds the same key as TEAM_A_KEY"),
    ],
)
def test_keys_that_cannot_be_used_are_named_at_start(
    auth: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(AuthSetupError) as raised:
        keys(auth, environ)
    assert message in str(raised.value)
    assert TEAM_KEY not in str(raised.value)


def test_a_priority_above_the_keys_is_capped_and_counted_not_refused() -> None:
    metrics = RouterMetrics().for_model("m")
    configured = keys()
    client = configured.authenticate(bearer(TEAM_KEY), CHAT)

    async def scenario() -> list[str]:
        granted: list[str] = []
        for asked in ("high", "normal", "low"):
            priority, slot = configured.admit(client, asked, metrics)
            assert isinstance(slot, QueueSlot)
            slot.release()
            granted.append(priority)
        return granted

    assert asyncio.run(scenario()) == ["normal", "normal", "low"]
    capped = "splitserve_priority_capped_total"
    assert sample(metrics, capped, key="TEAM_A_KEY", requested="high", granted="normal") == 1
    assert TEAM_KEY.encode() not in generate_latest(metrics.registry)


def test_a_keys_queue_cap_is_a_429_until_a_request_gets_its_first_token() -> None:
    metrics = RouterMetrics().for_model("m")
    configured = keys()
    client = configured.authenticate(bearer(TEAM_KEY), CHAT)

    async def scenario() -> None:
        first = configured.admit(client, "normal", metrics)[1]
        assert isinstance(first, QueueSlot)
        configured.admit(client, "normal", metrics)
        refused = configured.admit(client, "normal", metrics)[1]
        assert isinstance(refused, Refusal)
        assert (refused.reason, refused.retry_after_s) == (KEY_QUEUE_FULL, 2)
        assert Rejection(refused).status == 429  # its model's lifecycle raises it
        first.release()  # its first token
        first.release()  # once only
        assert configured.waiting("TEAM_A_KEY") == 1
        assert isinstance(configured.admit(client, "normal", metrics)[1], QueueSlot)

    asyncio.run(scenario())


async def test_a_request_that_ends_before_its_first_token_gives_its_place_back(
    team_key: None,
) -> None:
    """Refused after its key took it (a bad body), each request's life gives its place
    in the key's queue back: more of them than the key's cap are each answered 400,
    never the key's 429."""
    async with in_process_router(auth=AUTH) as router:
        for _ in range(3):  # more than the cap of 2
            bad = chat_body(max_tokens=0)
            response = await answer(
                router.chat_completions, http_request(CHAT, bad, bearer(TEAM_KEY))
            )
            assert response.status_code == 400, response.body
        assert router._auth.waiting("TEAM_A_KEY") == 0


LOOPBACK = {"127.0.0.1": True, "localhost": True, "::1": True, "[::1]": True}
REACHABLE = {"0.0.0.0": False, "::": False, "10.0.0.5": False, "router.internal": False}


@pytest.mark.parametrize(("host", "loopback"), [*LOOPBACK.items(), *REACHABLE.items()])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_router_without_keys_beyond_loopback_stops_unless_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.auth")
    with caplog.at_level(logging.INFO, logger="test.auth"):
        check_exposure(keys({}, {}), "127.0.0.1", False, logger)
        check_exposure(keys({}, {}), None, False, logger)  # host unknown: nothing to say
        assert not caplog.records
        with pytest.raises(AuthSetupError, match=r"Serve listens on 0\.0\.0\.0 and no API keys"):
            check_exposure(keys({}, {}), "0.0.0.0", False, logger)
        check_exposure(keys({}, {}), "0.0.0.0", True, logger)
        check_exposure(keys(), "0.0.0.0", False, logger)
    warning, info = caplog.records
    assert warning.levelno == logging.WARNING and "auth.allow_open" in warning.getMessage()
    assert info.levelno == logging.INFO and "TEAM_A_KEY, prometheus" in info.getMessage()


def test_metrics_and_health_stay_open_by_default_as_vllms_do() -> None:
    guarded = keys({"keys": [{"key_env": "TEAM_A_KEY"}]})
    assert guarded.refusal({}, "/metrics") is None
    assert guarded.refusal({}, "/health") is None
    assert guarded.refusal({}, "/v1/completions") is not None
    closed = keys({"keys": [{"key_env": "TEAM_A_KEY"}], "open_paths": ["/health"]})
    assert closed.refusal({}, "/metrics") is not None


# ---- the YAML's auth block -----------------------------------------------------------------


def _args(auth: dict[str, Any]) -> dict[str, Any]:
    return {"shape": "single", "pools": [{}], "auth": auth}


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"keys": [{"max_priority": "low"}]}, "give the key either by key_env"),
        ({"keys": [{"key": "a", "key_env": "A"}]}, "give the key either by key_env"),
        ({"keys": [{"key_env": "TEAM-A"}]}, "auth.keys.0.key_env: String should match pattern"),
        ({"keys": [{"key": "with space"}]}, "auth.keys.0.key: a key must be visible"),
        ({"keys": [{"key_env": "A", "max_priority": "urgent"}]}, "Input should be 'high'"),
        ({"keys": [{"key_env": "A", "max_queued": 0}]}, "greater than or equal to 1"),
        ({"keys": [{"key_env": "A", "routes": ["/v1/embeddings"]}]}, "routes.0: Input should"),
        ({"keys": [{"key_env": "A"}, {"key_env": "B", "name": "A"}]}, "repeated: ['A']"),
        ({"open_paths": ["/v1/chat/completions"]}, "open_paths.0: Input should be '/v1/models'"),
        ({"keyz": []}, "auth.keyz: Extra inputs are not permitted"),
    ],
)
def test_a_bad_auth_block_names_the_field(auth: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_app_config(_args(auth))
    assert message in str(raised.value)
    assert "with space" not in str(raised.value)  # a literal key is never echoed


def test_the_auth_block_reaches_the_router_and_defaults_to_no_keys() -> None:
    config = parse_app_config(_args(AUTH))
    settings = config.ingress_settings(http_host="0.0.0.0")
    assert settings.auth is config.auth and settings.http_host == "0.0.0.0"
    assert "sk-prometheus" not in repr(settings)  # a literal key prints as a secret
    assert parse_app_config(_args({})).auth.keys == []
    with pytest.raises(ValidationError):
        AuthConfig.model_validate({"keys": [{}]})


# ---- the router's request path --------------------------------------------------------------


@pytest.fixture
def team_key(monkeypatch: pytest.MonkeyPatch, no_environment_keys: None) -> None:
    monkeypatch.setenv("TEAM_A_KEY", TEAM_KEY)


@pytest.fixture
def replica_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """/health names its Serve replica; here there is none."""

    class Context:
        class replica_id:  # the shape of Serve's context
            unique_id = "in-process"

    monkeypatch.setattr(ingress.serve, "get_replica_context", Context)


async def test_the_router_answers_401_403_and_serves_a_good_key(
    team_key: None, replica_context: None
) -> None:
    async with in_process_router(auth=AUTH) as router:
        missing = await answer(router.chat_completions, http_request(CHAT, chat_body()))
        wrong = await answer(
            router.chat_completions, http_request(CHAT, chat_body(), bearer("sk-no"))
        )
        assert (missing.status_code, wrong.status_code) == (401, 401)
        assert json.loads(missing.body)["error"]["code"] == 401
        forbidden = await answer(
            router.chat_completions, http_request(CHAT, chat_body(), bearer(PROBE_KEY))
        )
        assert forbidden.status_code == 403
        served = await answer(
            router.chat_completions, http_request(CHAT, chat_body(), bearer(TEAM_KEY))
        )
        assert served.status_code == 200
        assert json.loads(served.body)["choices"][0]["finish_reason"] == "length"
        for route, call in (("/v1/models", router.models), ("/metrics", router.metrics)):
            assert (await answer(call, http_request(route, method="GET"))).status_code == 401
        metrics = await answer(
            router.metrics, http_request("/metrics", b"", bearer(PROBE_KEY), "GET")
        )
        assert metrics.status_code == 200 and TEAM_KEY.encode() not in metrics.body
        health = await answer(router.health, http_request("/health", method="GET"))
        assert health.status_code == 200  # open for probes
        requests = "splitserve_requests_total"
        # Refused before the body named a model: counted without one.
        unnamed = {"model": "", "route": CHAT, "status": "401", "priority": "normal"}
        assert sample(router._metrics, requests, **unnamed) == 2


async def test_the_router_serves_a_capped_priority_and_counts_it(team_key: None) -> None:
    async with in_process_router(auth=AUTH, qos={"enabled": True}) as router:
        headers = {**bearer(TEAM_KEY), "x-priority": "high"}
        served = await answer(router.chat_completions, http_request(CHAT, chat_body(), headers))
        assert served.status_code == 200
        labels = {"key": "TEAM_A_KEY", "requested": "high", "granted": "normal"}
        assert sample(router._metrics, "splitserve_priority_capped_total", **labels) == 1
        assert sample(
            router._metrics,
            "splitserve_requests_total",
            model=EMBEDDED_MODEL_NAME,
            route=CHAT,
            status="200",
            priority="normal",
        )
        assert router._auth.waiting("TEAM_A_KEY") == 0  # released at its first token


async def test_a_router_without_keys_stays_open(no_environment_keys: None) -> None:
    async with in_process_router() as router:
        served = await answer(router.chat_completions, http_request(CHAT, chat_body()))
        assert served.status_code == 200
