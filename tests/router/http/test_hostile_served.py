"""Hostile input over real HTTP: every class of bad request gets a 4xx in OpenAI's
format from the router, compared with what bare vLLM's own server answers, and a batch
of generated bodies never gets a 5xx.

Where we answer differently from vLLM it is on purpose and named here: OpenAI's API
requires a user message's ``content`` (vLLM templates it as empty), and a client may not
set the router's own engine-to-engine hand-over fields.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from deployments.launcher import RunningApp
from engines.tiny_model import EMBEDDED_MODEL_NAME
from tests.router.http.test_hostile_input import from_schema

pytestmark = pytest.mark.serving

M = EMBEDDED_MODEL_NAME
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
X = {"model": M, "prompt": "x"}
# (what is wrong, route, the body (raw bytes or JSON), does bare vLLM refuse it too?)
CASES: list[tuple[str, str, bytes | dict[str, Any], bool]] = [
    ("malformed JSON", COMPLETIONS, b'{"model": ', True),
    ("a JSON array", COMPLETIONS, b"[1, 2]", True),
    ("no prompt", COMPLETIONS, {"model": M}, True),
    ("prompt of the wrong type", COMPLETIONS, {**X, "prompt": 3.5}, True),
    ("negative max_tokens", COMPLETIONS, {**X, "max_tokens": -1}, True),
    ("max_tokens beyond the context", COMPLETIONS, {**X, "max_tokens": 10**6}, True),
    ("temperature as text", COMPLETIONS, {**X, "temperature": "hot"}, True),
    ("token ids outside the vocabulary", COMPLETIONS, {**X, "prompt": [10**7]}, True),
    ("an unknown model", COMPLETIONS, {**X, "model": "gpt-17"}, True),
    ("a lone surrogate in model", COMPLETIONS, b'{"model": "\\udcff", "prompt": "x"}', True),
    ("messages that is null", CHAT, {"model": M, "messages": None}, True),
    ("messages that is a number", CHAT, {"model": M, "messages": 0}, True),
    ("no messages", CHAT, {"model": M}, True),
    ("a message without a role", CHAT, {"model": M, "messages": [{"content": "x"}]}, True),
    ("a user message without content", CHAT, {"model": M, "messages": [{"role": "user"}]}, False),
    ("kv_transfer_params from a client", CHAT,
     {"model": M, "messages": USER, "kv_transfer_params": {"do_remote_prefill": True}}, False),
]  # fmt: skip


@pytest.fixture(scope="module")
def ours(bare_vllm_answers: dict[str, Any], shapes_app: RunningApp) -> str:
    # Bare vLLM first: it is stopped before the shared application starts beside it.
    """single.yaml's model, the first of the shapes' shared application (conftest.py)."""
    return shapes_app.base_url


def bare_vllm_reference(base_url: str) -> dict[str, int]:
    """Bare vLLM's status for each class of bad input (asked by conftest's
    bare_vllm_answers, of the one bare server the session starts)."""
    return {what: _post(base_url, route, body).status_code for what, route, body, _ in CASES}


@pytest.fixture(scope="module")
def bare_statuses(bare_vllm_answers: dict[str, Any]) -> dict[str, int]:
    return bare_vllm_answers[__name__]


def _post(base_url: str, route: str, body: bytes | dict[str, Any]) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{base_url}{route}", content=raw, headers=headers, timeout=120)


def _assert_openai_error(response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert error["code"] == response.status_code


@pytest.mark.parametrize(
    ("what", "route", "body", "vllm_refuses"), CASES, ids=[c[0] for c in CASES]
)
def test_each_class_of_bad_input_against_bare_vllm(
    ours: str,
    bare_statuses: dict[str, int],
    what: str,
    route: str,
    body: bytes | dict,
    vllm_refuses: bool,
) -> None:
    mine = _post(ours, route, body)
    _assert_openai_error(mine)
    theirs = bare_statuses[what]
    assert theirs < 500, f"bare vLLM answered {theirs} to {what}"
    # Refused by both, with the same class of status, unless we differ on purpose.
    assert (400 <= theirs < 500) == vllm_refuses, (what, theirs)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    st.one_of(
        from_schema(CompletionRequest.model_json_schema()),
        st.dictionaries(st.sampled_from(sorted(CompletionRequest.model_fields)), st.text()),
    )
)
def test_generated_bodies_never_get_a_server_error(ours: str, body: dict[str, Any]) -> None:
    if body.get("max_tokens") is None or isinstance(body.get("max_tokens"), int):
        body = {**body, "max_tokens": 2}  # an accepted body must not generate for minutes
    response = _post(ours, COMPLETIONS, body)
    if response.status_code != 200:
        _assert_openai_error(response)
