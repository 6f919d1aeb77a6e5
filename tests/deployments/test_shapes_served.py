"""Every shape, started with ``serve run deployments/<shape>.yaml`` on real vLLM engines.

With temperature 0 the generated token ids must be the same whichever way the engines
are split: ``single`` runs first and sets the reference the others are held to.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import yaml

from deployments.launcher import RunningApp, app_engine_pids
from tests.support.api_corpus import assert_answers_as
from tests.support.served_apps import ServedApps

pytestmark = pytest.mark.serving

# dp_apart: dp.yaml with each engine a Serve replica of its own, over the engine transport.
DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"
SHAPES = ["single", "dp", "dp_apart", "tp", "pp"]
MODEL = "splitserve-tiny-llama"
MAX_TOKENS = 12
TOKEN_PROMPTS = {
    "one-token": [65],
    "short": [72, 101, 108, 108, 111],
    "one-block": list(range(10, 26)),
    "long": [(i * 7) % 250 + 3 for i in range(700)],
}
CHAT_PROMPTS = {
    "greeting": "Hello there, who are you?",
    "question": "Explain pipeline parallelism in one sentence.",
}

# Ray titles a Serve replica's process after its application and deployment.
REPLICA_TITLE = re.compile(r"ServeReplica:splitserve:([\w-]+)")

# (kind, prompt name) -> token ids the 'single' shape generated.
_REFERENCE: dict[tuple[str, str], list[int]] = {}


def _config(shape: str, folder: Path) -> str:
    if shape != "dp_apart":
        return shape
    document = yaml.safe_load((DEPLOYMENTS / "dp.yaml").read_text())
    document["applications"][0]["args"]["router"]["engine_in_router"] = False
    path = folder / "dp_apart.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


@pytest.fixture(scope="module", params=SHAPES)
def app(request: pytest.FixtureRequest, served_apps: ServedApps, serve_logs: Path) -> RunningApp:
    if request.param == "single":
        # Other modules' references too, while single.yaml runs (conftest.py).
        request.getfixturevalue("single_answers")
    # Serving and stopping are not dying: served_apps checks that no replica restarted.
    return served_apps.get(_config(request.param, serve_logs))


@pytest.fixture(scope="module")
def client(app: RunningApp) -> Iterator[openai.OpenAI]:
    # Closed with its application's tests: a pooled connection the stopped router closed
    # would keep the port in FIN-WAIT-2 for a minute (served_apps.py).
    with openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _check_reference(app: RunningApp, key: tuple[str, str], token_ids: list[int]) -> None:
    assert len(token_ids) == MAX_TOKENS
    if app.config_path.stem == "single":
        _REFERENCE[key] = token_ids
    elif key in _REFERENCE:
        assert token_ids == _REFERENCE[key], f"{app.config_path.stem} differs from single on {key}"
    else:
        pytest.fail(f"no reference from 'single' for {key}: did the single shape run first?")


def _completion_kwargs() -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"return_token_ids": True, "ignore_eos": True},
    }


@pytest.mark.parametrize("name", TOKEN_PROMPTS)
def test_completion(app: RunningApp, client: openai.OpenAI, name: str) -> None:
    prompt = TOKEN_PROMPTS[name]
    response = client.completions.create(prompt=prompt, **_completion_kwargs())
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == MAX_TOKENS
    assert choice.prompt_token_ids == prompt
    _check_reference(app, ("completion", name), choice.token_ids)


@pytest.mark.parametrize("name", TOKEN_PROMPTS)
def test_completion_stream(app: RunningApp, client: openai.OpenAI, name: str) -> None:
    prompt = TOKEN_PROMPTS[name]
    stream = client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **_completion_kwargs()
    )
    token_ids: list[int] = []
    usage = None
    finish_reasons = []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            token_ids.extend(choice.token_ids or [])
            finish_reasons.append(choice.finish_reason)
    assert finish_reasons[-1] == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens == len(prompt)
    _check_reference(app, ("completion", name), token_ids)


@pytest.mark.parametrize("name", CHAT_PROMPTS)
def test_chat(app: RunningApp, client: openai.OpenAI, name: str) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPTS[name]}]
    response = client.chat.completions.create(messages=messages, **_completion_kwargs())
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert response.usage.completion_tokens == MAX_TOKENS
    _check_reference(app, ("chat", name), choice.token_ids)


@pytest.mark.parametrize("name", CHAT_PROMPTS)
def test_chat_stream(app: RunningApp, client: openai.OpenAI, name: str) -> None:
    messages = [{"role": "user", "content": CHAT_PROMPTS[name]}]
    stream = client.chat.completions.create(
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **_completion_kwargs(),
    )
    token_ids: list[int] = []
    roles = []
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            token_ids.extend(getattr(choice, "token_ids", None) or [])
    assert roles[0] == "assistant"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    _check_reference(app, ("chat", name), token_ids)


def test_every_kind_of_request_is_answered_as_bare_vllm(
    app: RunningApp, vllm_answers: dict[str, Any]
) -> None:
    """The API corpus (tests/support/api_corpus.py), each kind against `vllm serve`'s answer."""
    assert_answers_as(vllm_answers, app.base_url)


def test_engines_run_where_the_shape_puts_them(app: RunningApp) -> None:
    """Every engine's front end runs in the router's process, DP's two as well, unless
    the engines run apart: then each in a Serve replica of its own."""
    owners = set()
    for pid in app_engine_pids():
        with contextlib.suppress(psutil.NoSuchProcess):
            for parent in psutil.Process(pid).parents():
                found = REPLICA_TITLE.search(" ".join(parent.cmdline()))
                if found:
                    owners.add(found.group(1))
                    break
    apart = app.config_path.stem == "dp_apart"
    assert owners == ({"engine-0", "engine-1"} if apart else {"Router"})


def test_replicas_share_requests_evenly(app: RunningApp) -> None:
    """Round-robin: 20 requests on DP=2 are served 10 and 10; one replica serves them all else."""
    served_by: Counter[str] = Counter()
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        for i in range(20):
            response = http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": [1 + i, 2, 3], "max_tokens": 2},
            )
            assert response.status_code == 200, response.text
            served_by[response.headers["x-splitserve-replica"]] += 1
    expected = (
        {"engine-0": 10, "engine-1": 10}
        if app.config_path.stem.startswith("dp")
        else {"engine-0": 20}
    )
    assert dict(served_by) == expected
    metrics = httpx.get(f"{app.base_url}/metrics").text
    for replica, count in expected.items():
        labels = f'model="{MODEL}",replica="{replica}",role="mixed"'
        line = f"splitserve_replica_requests_total{{{labels}}}"
        assert any(
            row.startswith(line) and float(row.split()[-1]) >= count for row in metrics.splitlines()
        )


# ---- bad input: the OpenAI error body with the right status, on every shape ----------

BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 4096, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        },
        400,
        None,  # vLLM's layer renders it: "... is not a multimodal model"
    ),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_gets_openai_error(
    app: RunningApp, route: str, body: Any, status: int, param: str | None
) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{app.base_url}{route}", timeout=30, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status
    assert error["message"]
    assert error["type"] in ("BadRequestError", "NotFoundError")
    assert error["param"] == param


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10_000)


def _engine_requests(base_url: str, state: str) -> float:
    total = 0.0
    for row in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if row.startswith("splitserve_engine_requests{") and f'state="{state}"' in row:
            total += float(row.split()[-1])
    return total


def _wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_disconnect_aborts_request_in_engine(app: RunningApp) -> None:
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{app.base_url}/v1/completions"
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: ") for line in received)
        assert _wait_for(lambda: _engine_requests(app.base_url, "unfinished") >= 1, 10)
        # Leaving the block closes the connection mid-stream.
    assert _wait_for(lambda: _engine_requests(app.base_url, "unfinished") == 0, 20), (
        "the engine still holds the request after the client went away"
    )


def test_request_id_is_echoed_or_created(app: RunningApp) -> None:
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1}
    given = httpx.post(
        f"{app.base_url}/v1/completions", json=body, headers={"x-request-id": "trace-42"}
    )
    assert given.headers["x-request-id"] == "trace-42"
    assert given.json()["id"].endswith("trace-42")
    created = httpx.post(f"{app.base_url}/v1/completions", json=body)
    assert created.headers["x-request-id"]
    assert created.headers.get_list("x-request-id") == [created.headers["x-request-id"]]
