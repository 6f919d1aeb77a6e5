"""Every shape on real vLLM engines, as ``serve run`` serves it: each shipped YAML a model
of one application (tests/support/shared_apps.py), so that one start serves them all.

With temperature 0 the generated token ids must be the same whichever way the engines
are split: ``single`` runs first and sets the reference the others are held to. What
does not depend on the shape (bad input's statuses, typed errors, request ids) is
checked in-process (tests/router/http/test_http_api.py).
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import psutil
import pytest

from deployments.launcher import RunningApp, replica_engine_pids
from engines.step_log import RequestRecord, StepRecord, read_log
from tests.support.api_corpus import assert_answers_as
from tests.support.greedy import metric
from tests.support.shared_apps import SHAPES, SharedModel, step_log_file

pytestmark = pytest.mark.serving

SHAPE_NAMES = ["single", "dp", "dp_apart", "tp", "pp"]
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


@pytest.fixture(scope="module", params=SHAPE_NAMES)
def shape(request: pytest.FixtureRequest) -> SharedModel:
    if request.param == "single":
        # Other modules' references too, while the application runs (conftest.py).
        request.getfixturevalue("single_answers")
    return SHAPES[request.param]


@pytest.fixture(scope="module")
def app(shapes_app: RunningApp) -> RunningApp:
    return shapes_app


@pytest.fixture(scope="module")
def client(app: RunningApp) -> Iterator[openai.OpenAI]:
    # Closed with the module's tests: a pooled connection the stopped router closed
    # would keep the port in FIN-WAIT-2 for a minute (served_apps.py).
    with openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _check_reference(shape: SharedModel, key: tuple[str, str], token_ids: list[int]) -> None:
    assert len(token_ids) == MAX_TOKENS
    if shape is SHAPES["single"]:
        _REFERENCE[key] = token_ids
    elif key in _REFERENCE:
        assert token_ids == _REFERENCE[key], f"{shape.shipped} differs from single on {key}"
    else:
        pytest.fail(f"no reference from 'single' for {key}: did the single shape run first?")


def _completion_kwargs(shape: SharedModel) -> dict[str, Any]:
    return {
        "model": shape.name,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"return_token_ids": True, "ignore_eos": True},
    }


@pytest.mark.parametrize("name", TOKEN_PROMPTS)
def test_completion(shape: SharedModel, client: openai.OpenAI, name: str) -> None:
    prompt = TOKEN_PROMPTS[name]
    response = client.completions.create(prompt=prompt, **_completion_kwargs(shape))
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == MAX_TOKENS
    assert choice.prompt_token_ids == prompt
    _check_reference(shape, ("completion", name), choice.token_ids)


def test_the_engine_logs_each_step_as_a_profile_counts_it(
    shape: SharedModel, client: openai.OpenAI, serve_logs: Path
) -> None:
    """engine.step_log (single's engine logs its steps): one prompt's prefill, then a
    decode step a token, each reading one more token of context; then the request."""
    if not shape.step_log:
        pytest.skip("this shape's engines log no steps")
    log = step_log_file(serve_logs, shape)
    before = len(read_log(log)) if log.exists() else 0
    prompt = [(i * 11) % 240 + 5 for i in range(300)]  # no other test's prefix
    client.completions.create(prompt=prompt, **_completion_kwargs(shape))
    records = read_log(log)[before:]
    steps = [record for record in records if isinstance(record, StepRecord)]
    prefills = [step for step in steps if step.prefill_tokens]
    decodes = [step for step in steps if step.decode_seqs]
    assert sum(step.prefill_tokens for step in prefills) == len(prompt)
    assert all(step.prefill_seqs == 1 and not step.decode_seqs for step in prefills)
    # The whole prompt in one chunk: each query token attends to itself and those before.
    assert prefills[0].attention_pairs == len(prompt) * (len(prompt) + 1) // 2
    assert len(decodes) == MAX_TOKENS - 1  # the first token came with the prefill
    assert [step.decode_context_tokens for step in decodes] == [
        len(prompt) + 1 + k for k in range(MAX_TOKENS - 1)
    ]
    assert all(0 < step.seconds < 10 for step in steps)
    assert all(a.started < b.started for a, b in itertools.pairwise(steps))
    # And the request, once finished: taken in before its prefill, its tokens after.
    (request,) = [record for record in records if isinstance(record, RequestRecord)]
    assert (request.prompt_tokens, request.output_tokens) == (len(prompt), MAX_TOKENS)
    assert request.arrived < prefills[0].started < request.first_token
    assert request.first_token < request.last_token <= decodes[-1].started + 10


@pytest.mark.parametrize("name", TOKEN_PROMPTS)
def test_completion_stream(shape: SharedModel, client: openai.OpenAI, name: str) -> None:
    prompt = TOKEN_PROMPTS[name]
    kwargs = _completion_kwargs(shape)
    stream = client.completions.create(
        prompt=prompt, stream=True, stream_options={"include_usage": True}, **kwargs
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
    _check_reference(shape, ("completion", name), token_ids)


@pytest.mark.parametrize("name", CHAT_PROMPTS)
def test_chat(shape: SharedModel, client: openai.OpenAI, name: str) -> None:
    messages: Any = [{"role": "user", "content": CHAT_PROMPTS[name]}]
    response = client.chat.completions.create(messages=messages, **_completion_kwargs(shape))
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert response.usage is not None and response.usage.completion_tokens == MAX_TOKENS
    _check_reference(shape, ("chat", name), choice.token_ids)


@pytest.mark.parametrize("name", CHAT_PROMPTS)
def test_chat_stream(shape: SharedModel, client: openai.OpenAI, name: str) -> None:
    messages: Any = [{"role": "user", "content": CHAT_PROMPTS[name]}]
    kwargs: Any = _completion_kwargs(shape)
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kwargs
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
    _check_reference(shape, ("chat", name), token_ids)


def test_every_kind_of_request_is_answered_as_bare_vllm(
    shape: SharedModel, app: RunningApp, vllm_answers: dict[str, Any]
) -> None:
    """The API corpus (tests/support/api_corpus.py), each kind against `vllm serve`'s answer."""
    assert_answers_as(vllm_answers, app.base_url, shape.name)


def test_anthropics_sdk_reads_a_message_whole_and_streamed(
    shape: SharedModel, app: RunningApp
) -> None:
    """Anthropic's own client pointed at the router (as a coding agent given a base URL):
    the Messages API, whole and streamed, greedy, reads the same text either way."""
    question = dict(
        model=shape.name,
        max_tokens=MAX_TOKENS,
        # This SDK release no longer takes temperature as an argument; the API still does.
        extra_body={"temperature": 0},
        system="Answer briefly.",
        messages=[{"role": "user", "content": CHAT_PROMPTS["question"]}],
    )
    with anthropic.Anthropic(base_url=app.base_url, api_key="unused", max_retries=0) as client:
        whole = client.messages.create(**question)  # type: ignore[call-overload]
        with client.messages.stream(**question) as stream:  # type: ignore[arg-type]
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert whole.content[0].type == "text" and whole.content[0].text
    assert streamed == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (
        whole.stop_reason,
        whole.usage.output_tokens,
    )
    assert whole.usage.output_tokens <= MAX_TOKENS and whole.usage.input_tokens > 0


def _owner(pid: int) -> str | None:
    """The Serve deployment whose replica started an engine process."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for parent in psutil.Process(pid).parents():
            found = REPLICA_TITLE.search(" ".join(parent.cmdline()))
            if found:
                return found.group(1)
    return None


def test_engines_run_where_the_shape_puts_them(shape: SharedModel) -> None:
    """Every engine's front end runs in the router's process, DP's two as well, unless
    the engines run apart: then each in a Serve replica of its own."""
    engines = [shape.engine("mixed", index) for index in range(_engine_count(shape))]
    owners = {name: {_owner(pid) for pid in replica_engine_pids(name)} for name in engines}
    apart = shape is SHAPES["dp_apart"]
    assert owners == {name: {name if apart else "Router"} for name in engines}


def _engine_count(shape: SharedModel) -> int:
    return 2 if shape.shipped == "dp" else 1


def test_engines_share_requests_evenly(shape: SharedModel, app: RunningApp) -> None:
    """Round-robin: 20 requests on DP=2 are served 10 and 10; one engine serves them all else."""
    served_by: Counter[str] = Counter()
    with httpx.Client(base_url=app.base_url, timeout=60) as http:
        for i in range(20):
            response = http.post(
                "/v1/completions",
                json={"model": shape.name, "prompt": [1 + i, 2, 3], "max_tokens": 2},
            )
            assert response.status_code == 200, response.text
            served_by[response.headers["x-splitserve-replica"]] += 1
    count = _engine_count(shape)
    expected = {shape.engine("mixed", index): 20 // count for index in range(count)}
    assert dict(served_by) == expected
    for engine, requests in expected.items():
        labels = {"model": shape.name, "replica": engine, "role": "mixed"}
        assert metric(app.base_url, "splitserve_replica_requests_total", **labels) >= requests


def _engine_requests(base_url: str, shape: SharedModel, state: str) -> float:
    return metric(base_url, "splitserve_engine_requests", model=shape.name, state=state)


def _wait_for(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return bool(predicate())


def test_disconnect_aborts_request_in_engine(shape: SharedModel, app: RunningApp) -> None:
    body = {
        "model": shape.name,
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
        assert _wait_for(lambda: _engine_requests(app.base_url, shape, "unfinished") >= 1, 10)
        # Leaving the block closes the connection mid-stream.
    assert _wait_for(lambda: _engine_requests(app.base_url, shape, "unfinished") == 0, 20), (
        "the engine still holds the request after the client went away"
    )
